"""Each device's memory and the step time of one pipeline configuration, predicted from the
layers' FPropMeta and the schedule's action lists, with nothing built.

Memory per device, in bytes (float32 weights; activations as FPropMeta counts them):
  weights + gradient sums + optimizer slots   params x 4 x (2 + slots)
  + inputs                                    device 0: the global batch and its micro-batches
  + stored micro-batches                      the schedule's high-water mark x what one stored
                                              micro-batch keeps: its cell's input under recompute;
                                              the input and every activation without
  + working set                               while one micro-batch's backward runs: the cell's
                                              weight gradients before they are summed (M > 1), the
                                              gradients through its largest layer and, under
                                              recompute, its activations again
Step time: the schedule's action lists simulated (schedules.simulate) with each stage's own
forward and backward times — flops / the device's rate (B = 2F), or per-layer times measured on
this machine (`layer_seconds`) — plus the recompute of every micro-batch the engine does not keep
(B also runs F; for zero_bubble, B and W each do), and each hand-off between devices delaying
the receiving action by bytes / link bandwidth + latency.
"""

import dataclasses
import functools

from tf_gpipe import base_layer
from tf_gpipe.gpipe import executor, partition, schedules

RECOMPUTE = ('always', 'except_last', 'never')
FLOAT32 = 4


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Predicted bytes on one device."""

    device: int
    layers: str
    params: int
    weights: int
    gradients: int
    slots: int
    inputs: int
    stored_activations: int
    working_set: int

    @property
    def peak(self):
        return (
            self.weights
            + self.gradients
            + self.slots
            + self.inputs
            + self.stored_activations
            + self.working_set
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    """One configuration's prediction (times in seconds, memory in bytes)."""

    num_devices: int
    num_micro_batches: int
    schedule: str
    recompute: str
    virtual_stages: int
    batch_size: int
    stages: tuple  # StageMemory per device
    step_seconds: float
    bubble: float
    timeline: tuple  # (phase, stage, micro_batch, start, end) of every simulated action

    @property
    def peak(self):
        return max(s.peak for s in self.stages)

    @property
    def params(self):
        return sum(s.params for s in self.stages)

    @property
    def examples_per_second(self):
        return self.batch_size / self.step_seconds if self.step_seconds else float('inf')

    def fits(self, device):
        return self.peak <= device.memory_bytes


@functools.lru_cache(maxsize=256)
def _holdings(schedule, k, m, v):
    """Per device, the (stored, pending) counts at every point of its action list: stored
    micro-batches (from F to their last backward action) and, when the backward is split,
    those between B and W (their gradients at the weights' uses wait for W)."""
    sched = schedules.build(schedule, k, m, v)
    last = schedules.WEIGHT if sched.split_backward else schedules.BACKWARD
    result = []
    for acts in sched.actions:
        stored = pending = 0
        points = set()
        for a in acts:
            if a.phase == schedules.FORWARD:
                stored += 1
            elif a.phase == schedules.BACKWARD and sched.split_backward:
                pending += 1
            points.add((stored, pending))
            if a.phase == last:
                stored -= 1
                pending -= 1 if sched.split_backward else 0
        result.append(tuple(sorted(points)))
    return tuple(result)


def _cells(sub, metas, input_bytes, k, v, m, partition_by):
    """Per cell, per micro-batch: params, flops, activations, largest layer, input, output."""
    costs = partition.meta_costs(metas, partition_by)
    splits = partition.balance(costs, k * v, [partition.passed_on(meta) for meta in metas])
    cells = []

    def output_bytes(meta):  # what a layer passes on (its activations may be far more)
        return base_layer.num_elements(meta.out_shapes) * FLOAT32

    for a, b in partition.blocks(splits):
        inputs = input_bytes if a == 0 else output_bytes(metas[a - 1])
        cells.append(
            dict(
                first=a,
                last=b,
                label=partition.block_label(sub, a, b),
                params=sum(meta.param_count for meta in metas[a:b]),
                flops=sum(meta.flops for meta in metas[a:b]) / m,
                activations=sum(meta.activation_bytes for meta in metas[a:b]) / m,
                largest=max(meta.activation_bytes for meta in metas[a:b]) / m,
                boundary=inputs / m,
                output=output_bytes(metas[b - 1]) / m,
            )
        )
    return cells


def _stage_memory(d, mine, holdings, recompute, optimizer_slots, input_bytes, m):
    params = sum(c['params'] for c in mine)
    never = recompute == 'never'

    def kept(c):  # what one stored micro-batch keeps; device 0's inputs are counted apart
        boundary = 0 if c['first'] == 0 else c['boundary']
        return boundary + (c['activations'] if never else 0)

    def pending(c):  # a split backward's B-to-W gradients (recompute: the cell's output's)
        return c['activations'] if never else c['output']

    stored = max(
        n * max(kept(c) for c in mine) + w * max(pending(c) for c in mine) for n, w in holdings
    )
    # One micro-batch's backward: its cell's weight gradients (made before they are added to
    # the sums; with one micro-batch they are the sums), the gradients flowing through the
    # largest layer and, under recompute, the cell's activations again.
    working = max(
        (c['params'] * FLOAT32 if m > 1 else 0) + c['largest'] + (0 if never else c['activations'])
        for c in mine
    )
    return StageMemory(
        device=d,
        layers=', '.join(c['label'] for c in mine),
        params=params,
        weights=params * FLOAT32,
        gradients=params * FLOAT32,
        slots=params * FLOAT32 * optimizer_slots,
        # The batch, and (M > 1) its micro-batch slices.
        inputs=(2 if m > 1 else 1) * input_bytes if d == 0 else 0,
        stored_activations=int(stored),
        working_set=int(working),
    )


def _stage_times(cells, device, layer_seconds, sched, recompute):
    """Per stage: F, B (and W) seconds of one micro-batch, and the hand-off between devices."""
    kept = executor.kept_micro_batches(sched, recompute)  # the engine's own rule
    m = sched.num_micro_batches
    forward, backward, weight = [], [], []
    for s, c in enumerate(cells):
        if layer_seconds is not None:
            f = sum(layer_seconds[i][0] for i in range(c['first'], c['last']))
            b = sum(layer_seconds[i][1] for i in range(c['first'], c['last']))
        else:
            f = c['flops'] / device.flops_per_second
            b = 2 * f
        # A recomputed micro-batch's backward runs its forward first; an action's cost is the
        # stage's mean over its micro-batches.
        redo = f * sum((s, i) not in kept for i in range(m)) / m
        forward.append(f)
        if sched.split_backward:  # B: the input gradient; W: the weight gradient (each recomputes)
            backward.append(b / 2 + redo)
            weight.append(b / 2 + redo)
        else:
            backward.append(b + redo)

    def transfer(dep, action):
        # F(s) gets cell s-1's output; B(s) gets the gradient of cell s+1's input (its size).
        forward = action.phase == schedules.FORWARD
        size = cells[dep.stage]['output' if forward else 'boundary']
        return size / device.link_bytes_per_second + device.link_latency_seconds

    return forward, backward, weight or None, transfer


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
    layer_seconds=None,
):
    """Plan for the layer params `sub` on batches of `input_shape` (batch first, the global
    batch), cut into num_devices x virtual_stages cells by `partition_by`.

    `layer_seconds`: per layer, (forward, backward) seconds of one micro-batch measured on the
    device (planning.measure); without it, times are flops / device.flops_per_second, B = 2F.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f'recompute must be one of {RECOMPUTE}, got {recompute!r}.')
    k, m, v = num_devices, num_micro_batches, virtual_stages
    sched = schedules.build(schedule, k, m, v)  # also checks K, M and v, naming the problem
    metas = metas if metas is not None else partition.layer_metas(sub, input_shape)
    if layer_seconds is not None and len(layer_seconds) != len(metas):
        raise ValueError(f'layer_seconds has {len(layer_seconds)} entries for {len(metas)} layers.')
    batch = int(input_shape[0])
    if m > batch:
        raise ValueError(f'num_micro_batches={m} is larger than the batch ({batch}).')
    input_bytes = base_layer.num_elements(input_shape) * FLOAT32
    cells = _cells(sub, metas, input_bytes, k, v, m, partition_by)
    holdings = _holdings(schedule, k, m, v)
    stages = tuple(
        _stage_memory(
            d,
            [c for s, c in enumerate(cells) if sched.device_of(s) == d],
            holdings[d],
            recompute,
            optimizer_slots,
            input_bytes,
            m,
        )
        for d in range(k)
    )
    costs = _stage_times(cells, device, layer_seconds, sched, recompute)
    sim = schedules.simulate(sched, *costs)
    timeline = tuple(
        (a.phase, a.stage, a.micro_batch, start, end) for a, (start, end) in sim.times.items()
    )
    return Plan(k, m, schedule, recompute, v, batch, stages, sim.makespan, sim.bubble, timeline)
