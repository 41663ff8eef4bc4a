"""Plan before you buy: each stage's memory and the step time of a pipeline, predicted from the
layers' FPropMeta and the schedule's action lists, with nothing built.

Memory per device, in bytes (float32 weights and activations unless the meta says otherwise):
  weights + gradient sums + optimizer slots  (params x 4 x (2 + slots))
  + stored micro-batches                     (the schedule's high-water mark x what one stored
                                              micro-batch keeps: its cell's input under
                                              recompute, every activation of the cell without)
  + working set                              (one micro-batch's cell activations and their
                                              gradients while its backward runs)
Step time: the schedule's action lists simulated (schedules.simulate) with F = the slowest
device's forward flops per micro-batch / the device's effective rate, B = 2F (+F when the
forward is recomputed; split, B = W = F (+F each when recomputed) for zero_bubble), plus the boundary transfer
(bytes / link bandwidth + latency) on every hand-off. These are estimates: `tools/plan.py`
prints them next to measurements where we have them (docs), and the README says how far off.
"""

import dataclasses

from tf_gpipe import base_layer
from tf_gpipe.gpipe import partition, schedules

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator: memory, effective compute rate and the link to its neighbour stage."""

    name: str
    memory_bytes: int
    flops_per_second: float  # effective: peak x an assumed utilisation (see DEVICES)
    link_bytes_per_second: float
    link_latency_seconds: float = 10e-6


# Peak dense rates (bf16/fp16 tensor units; fp32 for 'cpu') at an assumed 40% utilisation, and
# the stage-to-stage link (ICI for TPU cores, NVLink for GPUs). Profiles, not measurements.
_UTILISATION = 0.4
DEVICES = {
    'tpu-v2': Device('TPU v2 core', 8 * GIB, 22.5e12 * _UTILISATION, 62.5e9),
    'tpu-v3': Device('TPU v3 core', 16 * GIB, 61.5e12 * _UTILISATION, 81.25e9),
    'v100-16gb': Device('V100 16 GB', 16 * GIB, 125e12 * _UTILISATION, 150e9),
    'v100-32gb': Device('V100 32 GB', 32 * GIB, 125e12 * _UTILISATION, 150e9),
    'a100-40gb': Device('A100 40 GB', 40 * GIB, 312e12 * _UTILISATION, 300e9),
    'a100-80gb': Device('A100 80 GB', 80 * GIB, 312e12 * _UTILISATION, 300e9),
    'h100-80gb': Device('H100 80 GB', 80 * GIB, 989e12 * _UTILISATION, 450e9),
}

RECOMPUTE = ('always', 'except_last', 'never')


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Predicted bytes on one device."""

    device: int
    layers: str
    params: int
    weights: int
    gradients: int
    slots: int
    stored_activations: int
    working_set: int

    @property
    def peak(self):
        return (
            self.weights + self.gradients + self.slots + self.stored_activations + self.working_set
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    """One configuration's prediction."""

    num_devices: int
    num_micro_batches: int
    schedule: str
    recompute: str
    virtual_stages: int
    batch_size: int
    stages: tuple  # StageMemory per device
    step_seconds: float
    bubble: float

    @property
    def peak(self):
        return max(s.peak for s in self.stages)

    @property
    def examples_per_second(self):
        return self.batch_size / self.step_seconds if self.step_seconds else float('inf')

    def fits(self, device):
        return self.peak <= device.memory_bytes


def plan(
    sub,
    input_shape,
    num_devices,
    num_micro_batches,
    device,
    schedule='gpipe',
    recompute='always',
    optimizer_slots=1,
    virtual_stages=1,
    partition_by='flops',
    metas=None,
):
    """Plan for the layer params `sub` on batches of `input_shape` (batch first, the global
    batch), cut into num_devices x virtual_stages cells by `partition_by`."""
    if recompute not in RECOMPUTE:
        raise ValueError(f'recompute must be one of {RECOMPUTE}, got {recompute!r}.')
    k, m, v = num_devices, num_micro_batches, virtual_stages
    sched = schedules.build(schedule, k, m, v)  # also checks K, M and v, naming the problem
    metas = metas if metas is not None else partition.layer_metas(sub, input_shape)
    batch = int(input_shape[0])
    if m > batch:
        raise ValueError(f'num_micro_batches={m} is larger than the batch ({batch}).')
    # The cells the engine would cut: the same costs and the same tie-break.
    costs = partition.meta_costs(metas, partition_by)
    splits = partition.balance(costs, k * v, [partition.passed_on(meta) for meta in metas])
    cells = partition.blocks(splits)
    input_bytes = base_layer.num_elements(input_shape) * 4
    per_cell = []
    for a, b in cells:
        inputs = input_bytes if a == 0 else metas[a - 1].activation_bytes
        per_cell.append(
            dict(
                label=partition.block_label(sub, a, b),
                params=sum(meta.param_count for meta in metas[a:b]),
                flops=sum(meta.flops for meta in metas[a:b]) / m,  # per micro-batch
                activations=sum(meta.activation_bytes for meta in metas[a:b]) / m,
                boundary=inputs / m,  # the cell's input, one micro-batch
                output=metas[b - 1].activation_bytes / m,
            )
        )
    high_water = schedules.simulate(sched).high_water
    stages = []
    for d in range(k):
        mine = [c for i, c in enumerate(per_cell) if i % k == d]
        params = sum(c['params'] for c in mine)
        kept = max(c['boundary'] if recompute != 'never' else c['activations'] for c in mine)
        stored = high_water[d] * kept
        if recompute == 'except_last':  # the last micro-batch keeps all its activations
            stored += max(c['activations'] - c['boundary'] for c in mine)
        working = max(c['activations'] for c in mine) * (2 if recompute != 'never' else 1)
        stages.append(
            StageMemory(
                device=d,
                layers=', '.join(c['label'] for c in mine),
                params=params,
                weights=params * 4,
                gradients=params * 4,
                slots=params * 4 * optimizer_slots,
                stored_activations=int(stored),
                working_set=int(working),
            )
        )
    forward = max(c['flops'] for c in per_cell) / device.flops_per_second
    transfer = max(c['output'] for c in per_cell) / device.link_bytes_per_second
    transfer += device.link_latency_seconds if k > 1 else 0.0
    hop = transfer if k > 1 else 0.0
    redo = forward if recompute != 'never' else 0.0
    if sched.split_backward:  # a recomputed micro-batch's W recomputes its cell too
        sim = schedules.simulate(sched, forward + hop, forward + redo + hop, forward + redo)
    else:
        sim = schedules.simulate(sched, forward + hop, 2 * forward + redo + hop)
    return Plan(k, m, schedule, recompute, v, batch, tuple(stages), sim.makespan, sim.bubble)


def recommend(sub, input_shape, num_devices, device, optimizer_slots=1, micro_batches=None):
    """Every (M, schedule, recompute) plan, the ones that fit first, fastest first."""
    batch = int(input_shape[0])
    metas = partition.layer_metas(sub, input_shape)
    options = micro_batches or [m for m in (1, 2, 4, 8, 16, 32, 64, 128) if m <= batch]
    plans = []
    for m in options:
        for schedule in ('gpipe', '1f1b', 'zero_bubble'):
            for recompute in RECOMPUTE:
                if num_devices == 1 and schedule != 'gpipe':
                    continue  # one device: every schedule is the same sequence
                plans.append(
                    plan(
                        sub,
                        input_shape,
                        num_devices,
                        m,
                        device,
                        schedule,
                        recompute,
                        optimizer_slots,
                        metas=metas,
                    )  # fmt: skip
                )
    return sorted(plans, key=lambda p: (not p.fits(device), -p.examples_per_second, p.peak))
