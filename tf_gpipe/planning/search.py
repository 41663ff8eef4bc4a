"""Searches over plans: every (M, schedule, recompute) ranked, and the largest model that fits."""

from tf_gpipe.gpipe import partition
from tf_gpipe.planning import predict

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
SCHEDULES = ('gpipe', '1f1b', 'zero_bubble')


def _plans(sub, input_shape, num_devices, device, configs, optimizer_slots, layer_seconds=None):
    """One plan per config (M, schedule, recompute[, partition_by]; an M above the batch is an
    error), the layers' metas computed once, `layer_seconds(M)` (if given) once per M."""
    metas = partition.layer_metas(sub, input_shape)
    seconds = {}
    plans = []
    for config in configs:
        m, schedule, recompute, by = (tuple(config) + ('flops',))[:4]
        if layer_seconds and m not in seconds:
            seconds[m] = layer_seconds(m)
        plans.append(
            predict.plan(
                sub,
                input_shape,
                num_devices,
                m,
                device,
                schedule,
                recompute,
                optimizer_slots,
                partition_by=by,
                metas=metas,
                layer_seconds=seconds.get(m),
            )  # fmt: skip
        )
    return plans


def recommend(
    sub,
    input_shape,
    num_devices,
    device,
    optimizer_slots=1,
    micro_batches=None,
    layer_seconds=None,
):
    """Every (M, schedule, recompute) plan, the ones that fit first, fastest first.

    `layer_seconds`: None, or a function of M giving per-layer (forward, backward) seconds of
    one micro-batch (measured on this machine: planning.measure.layer_seconds)."""
    options = micro_batches or [m for m in MICRO_BATCHES if m <= int(input_shape[0])]
    # One device: every schedule is the same sequence.
    names = SCHEDULES if num_devices > 1 else ('gpipe',)
    configs = [(m, s, r) for m in options for s in names for r in predict.RECOMPUTE]
    plans = _plans(sub, input_shape, num_devices, device, configs, optimizer_slots, layer_seconds)
    return sorted(plans, key=lambda p: (not p.fits(device), -p.examples_per_second, p.peak))


def smallest_peak(sub, input_shape, num_devices, device, configs, optimizer_slots=1):
    """The plan of least peak among `configs`: (M, schedule, recompute[, partition_by]) each
    (partition_by 'flops' when not given; 'params' spreads the weights and their slots)."""
    usable = [c for c in configs if c[0] <= input_shape[0]]  # a small batch takes fewer M
    plans = _plans(sub, input_shape, num_devices, device, usable, optimizer_slots)
    return min(plans, key=lambda p: p.peak)


def largest(make, num_devices, device, configs, optimizer_slots=1, start=1, limit=1 << 16):
    """(knob, plan): the largest knob whose model `make(knob)` -> (sub, input_shape) fits
    `device` under one of `configs` (see smallest_peak); knob 0 when none does.

    Doubling from `start`, then bisection: the knob must grow the model's memory monotonically.
    """

    def trial(knob):
        sub, shape = make(knob)
        if len(sub) < num_devices:
            return None  # too few layers for K cells: not a model of this size
        best = smallest_peak(sub, shape, num_devices, device, configs, optimizer_slots)
        return best if best.fits(device) else None

    lo, lo_plan, hi = 0, None, None
    knob = start
    while knob <= limit:
        found = trial(knob)
        if found is None:
            hi = knob
            break
        lo, lo_plan, knob = knob, found, 2 * knob
    if hi is None:
        raise ValueError(f'Everything up to knob {limit} fits: raise the limit.')
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = trial(mid)
        if found is None:
            hi = mid
        else:
            lo, lo_plan = mid, found
    return lo, lo_plan
