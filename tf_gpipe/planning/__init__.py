"""Plan before you buy: each device's memory and the step time of a pipeline for any K, M,
schedule and recompute policy, predicted from FPropMeta and the schedules' action lists.

devices   device profiles (TPU v2/v3 cores, V100, A100, H100) and `get`
predict   `plan`: one configuration's per-device memory and simulated step time
search    `recommend` (every M, schedule, policy ranked) and `largest` (the biggest model that fits)
measure   "this machine": per-layer times and the link between two worker processes, measured
"""

from tf_gpipe.planning import search
from tf_gpipe.planning.devices import DEVICES, GIB, THIS_MACHINE, Device, get
from tf_gpipe.planning.predict import RECOMPUTE, Plan, StageMemory, plan
from tf_gpipe.planning.search import largest, recommend

__all__ = [
    'DEVICES',
    'GIB',
    'RECOMPUTE',
    'THIS_MACHINE',
    'Device',
    'Plan',
    'StageMemory',
    'get',
    'largest',
    'plan',
    'recommend',
    'search',
]
