"""GPipe's fill-drain schedule as data: a list of (clock, stage, micro_batch, phase) actions.

Forward: at clock c, stage k runs micro-batch c - k (a diagonal wave, M + K - 1 clocks).
Backward: the wave runs back from the last stage, last micro-batch first, another M + K - 1
clocks. The executor builds ops in this order and chains each stage's actions with control
dependencies; the timeline tool draws the same list.
"""

import collections

Action = collections.namedtuple('Action', ['clock', 'stage', 'micro_batch', 'phase'])

FORWARD = 'F'
BACKWARD = 'B'


def forward_schedule(num_stages, num_micro_batches):
    """Forward actions in clock order (stage order within a clock)."""
    _check(num_stages, num_micro_batches)
    actions = []
    for clock in range(num_micro_batches + num_stages - 1):
        for stage in range(num_stages):
            m = clock - stage
            if 0 <= m < num_micro_batches:
                actions.append(Action(clock, stage, m, FORWARD))
    return actions


def backward_schedule(num_stages, num_micro_batches, start_clock=None):
    """Backward actions in clock order (last stage first within a clock)."""
    _check(num_stages, num_micro_batches)
    if start_clock is None:
        start_clock = num_micro_batches + num_stages - 1
    actions = []
    for step in range(num_micro_batches + num_stages - 1):
        for stage in reversed(range(num_stages)):
            m = num_micro_batches - 1 - (step - (num_stages - 1 - stage))
            if 0 <= m < num_micro_batches:
                actions.append(Action(start_clock + step, stage, m, BACKWARD))
    return actions


def gpipe_schedule(num_stages, num_micro_batches):
    """The whole training step: forward then backward, 2 * (M + K - 1) clocks."""
    return forward_schedule(num_stages, num_micro_batches) + backward_schedule(
        num_stages, num_micro_batches
    )


def per_stage(actions):
    """{stage: [actions in the order that stage runs them]}."""
    out = collections.defaultdict(list)
    for action in sorted(actions, key=lambda a: a.clock):
        out[action.stage].append(action)
    return dict(out)


def bubble_fraction(num_stages, num_micro_batches):
    """Idle share of each device in the ideal schedule: (K - 1) / (M + K - 1)."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def _check(num_stages, num_micro_batches):
    for name, value in (('num_stages', num_stages), ('num_micro_batches', num_micro_batches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f'{name} must be a positive int, got {value!r}.')
