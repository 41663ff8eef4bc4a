"""Pipeline schedules as data: per device, the ordered actions of one training step.

An action is F (forward), B (backward: the input gradient, and the weight gradient unless the
schedule splits it off) or W (the weight gradient alone) of one stage for one micro-batch. A
stage is one cell; with `virtual_stages=v` the layer sequence is cut into K*v stages and stage s
runs on device s mod K. A schedule is built by a pure function, checked by `validate` (every
action exactly once on its stage's device, dependencies satisfiable, no deadlock) and simulated
by `simulate` (unit-cost timeline, bubble, each device's high-water mark of stored
micro-batches). The executor runs the lists; the timeline tool draws them.

| schedule | stored micro-batches on device d (peak) | bubble (F = B = W, B+W = 2F) |
|---|---|---|
| gpipe (fill-drain) | M | (K-1)/(M+K-1) |
| 1f1b | min(M, K-d) | (K-1)/(M+K-1) |
| interleaved_1f1b | min(v*M, 2(K-d-1) + (v-1)K + 1) chunk-micro-batches (1/v each) | (K-1)/(v*M+K-1) |
| zero_bubble (ZB-H1) | min(M, K) | (K-1)/(3M+K-1) with F = B = W (1F1B: 3(K-1)/(3M+3(K-1))) |
"""

import collections
import dataclasses

FORWARD, BACKWARD, WEIGHT = 'F', 'B', 'W'
SCHEDULES = ('gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble')

Action = collections.namedtuple('Action', ['phase', 'stage', 'micro_batch'])
Action.__str__ = lambda a: f'{a.phase}{a.stage}.{a.micro_batch}'


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One training step of K devices, S = K*v stages and M micro-batches."""

    name: str
    num_devices: int
    num_stages: int
    num_micro_batches: int
    actions: tuple  # per device: a tuple of Actions, in the order that device runs them
    split_backward: bool = False  # True: B is the input gradient only, W the weight gradient

    def device_of(self, stage):
        return stage % self.num_devices

    def __str__(self):
        return '\n'.join(
            f'device {d}: ' + ' '.join(str(a) for a in acts) for d, acts in enumerate(self.actions)
        )


def build(name, num_devices, num_micro_batches, virtual_stages=1):
    """The schedule `name` (one of SCHEDULES), validated."""
    _check_positive(num_devices=num_devices, num_micro_batches=num_micro_batches)
    _check_positive(virtual_stages=virtual_stages)
    if name not in SCHEDULES:
        import difflib

        close = difflib.get_close_matches(str(name), SCHEDULES, 1)
        hint = f" (did you mean '{close[0]}'?)" if close else ''
        raise ValueError(f'Unknown schedule {name!r}{hint}; use one of {SCHEDULES}.')
    if virtual_stages != 1 and name != 'interleaved_1f1b':
        raise ValueError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved_1f1b' (got {name!r})."
        )
    builders = {
        'gpipe': gpipe,
        '1f1b': one_f_one_b,
        'zero_bubble': zero_bubble,
    }
    if name == 'interleaved_1f1b':
        sched = interleaved_1f1b(num_devices, num_micro_batches, virtual_stages)
    else:
        sched = builders[name](num_devices, num_micro_batches)
    validate(sched)
    return sched


def gpipe(num_devices, num_micro_batches):
    """Fill-drain: every forward, then every backward (last micro-batch first)."""
    k, m = num_devices, num_micro_batches
    actions = [
        tuple(Action(FORWARD, d, i) for i in range(m))
        + tuple(Action(BACKWARD, d, i) for i in reversed(range(m)))
        for d in range(k)
    ]
    return Schedule('gpipe', k, k, m, tuple(actions))


def one_f_one_b(num_devices, num_micro_batches):
    """1F1B: K-1-d warm-up forwards, then one forward and one backward in turn, then drain.

    Device d stores at most min(M, K-d) micro-batches, whatever M is (fill-drain stores M).
    """
    k, m = num_devices, num_micro_batches
    actions = []
    for d in range(k):
        warm = min(k - 1 - d, m)
        acts = [Action(FORWARD, d, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action(FORWARD, d, warm + i), Action(BACKWARD, d, i)]
        acts += [Action(BACKWARD, d, i) for i in range(m - warm, m)]
        actions.append(tuple(acts))
    return Schedule('1f1b', k, k, m, tuple(actions))


def interleaved_1f1b(num_devices, num_micro_batches, virtual_stages):
    """Interleaved 1F1B (Megatron-LM): device d holds stages d, d+K, ..., d+(v-1)K.

    Micro-batches go through the device's v chunks in groups of K, so the fill and drain take
    v times shorter steps: the bubble shrinks by v for the price of v times more boundary
    transfers. M must be a multiple of K.
    """
    k, m, v = num_devices, num_micro_batches, virtual_stages
    if m % k:
        raise ValueError(
            f'interleaved_1f1b runs micro-batches in groups of K={k}: num_micro_batches={m} '
            f'must be a multiple of {k} (e.g. {(m // k + 1) * k}).'
        )
    total = m * v

    def unit(i, forward):
        # The i-th forward (backward) of a device: chunk and micro-batch, groups of K.
        chunk = (i // k) % v
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (i // (k * v)) * k + i % k

    actions = []
    for d in range(k):
        warm = min((k - d - 1) * 2 + (v - 1) * k, total)
        acts = []
        for i in range(warm):
            chunk, mb = unit(i, True)
            acts.append(Action(FORWARD, chunk * k + d, mb))
        for i in range(total - warm):
            chunk, mb = unit(warm + i, True)
            acts.append(Action(FORWARD, chunk * k + d, mb))
            chunk, mb = unit(i, False)
            acts.append(Action(BACKWARD, chunk * k + d, mb))
        for i in range(total - warm, total):
            chunk, mb = unit(i, False)
            acts.append(Action(BACKWARD, chunk * k + d, mb))
        actions.append(tuple(acts))
    return Schedule('interleaved_1f1b', k, k * v, m, tuple(actions))


def zero_bubble(num_devices, num_micro_batches):
    """ZB-H1 (Qi et al. 2023): 1F1B with the weight gradient W split from B and deferred.

    Built by a list scheduler on unit costs (F = B = W): a free device runs a ready B first,
    else a ready F while it stores fewer than K micro-batches (1F1B's peak, on device 0), and
    runs its oldest pending W whenever the B or F would have to wait — W fills what would be a
    bubble. A micro-batch stays stored until its W ends. Makespan within a few units of the
    paper's 3M + K - 1 (1F1B: 3M + 3(K - 1)).
    """
    k, m = num_devices, num_micro_batches
    lists = [[] for _ in range(k)]
    done = {}  # action -> end time
    free_at = [0] * k
    next_f, next_b = [0] * k, [0] * k
    pending_w = [collections.deque() for _ in range(k)]
    for _ in range(3 * k * m):
        # Among the devices' next picks, the one that starts first (then the lower device).
        best = None
        for d in range(k):
            pick = _zb_pick(d, k, m, done, free_at[d], next_f, next_b, pending_w[d])
            if pick is not None:
                start = max(free_at[d], pick[1])
                if best is None or (start, d) < best[:2]:
                    best = (start, d, pick[0])
        start, d, action = best  # never None: some device always has a ready action
        done[action] = free_at[d] = start + 1
        lists[d].append(action)
        if action.phase == FORWARD:
            next_f[d] += 1
        elif action.phase == BACKWARD:
            next_b[d] += 1
            pending_w[d].append(action.micro_batch)
        else:
            pending_w[d].popleft()
    return Schedule('zero_bubble', k, k, m, tuple(tuple(x) for x in lists), split_backward=True)


def _zb_pick(d, k, m, done, free_at, next_f, next_b, pending_w):
    """(action, time its inputs are ready) that device d would run next, or None."""
    pick = None
    if next_b[d] < m:
        i = next_b[d]
        deps = [Action(FORWARD, d, i)] + ([Action(BACKWARD, d + 1, i)] if d < k - 1 else [])
        if all(a in done for a in deps):
            pick = Action(BACKWARD, d, i), max(done[a] for a in deps)
    stored = next_f[d] - (next_b[d] - len(pending_w))  # forwarded, W not yet done
    if pick is None and next_f[d] < m and stored < k:
        i = next_f[d]
        deps = [Action(FORWARD, d - 1, i)] if d else []
        if all(a in done for a in deps):
            pick = Action(FORWARD, d, i), max([done[a] for a in deps], default=0)
    if pending_w and (pick is None or pick[1] > free_at):
        i = pending_w[0]
        pick = Action(WEIGHT, d, i), done[Action(BACKWARD, d, i)]
    return pick


def dependencies(sched, action):
    """The actions `action` needs first (its data): the previous stage's forward, the next
    stage's backward, its own forward, its own backward (for W)."""
    phase, s, i = action
    last = sched.num_stages - 1
    if phase == FORWARD:
        return [Action(FORWARD, s - 1, i)] if s else []
    if phase == BACKWARD:
        return [Action(FORWARD, s, i)] + ([Action(BACKWARD, s + 1, i)] if s < last else [])
    return [Action(BACKWARD, s, i)]


def validate(sched):
    """Checks every action is present once on its stage's device and the lists can run to the
    end (no deadlock); raises ValueError naming the problem. Returns `simulate(sched)`."""
    want = collections.Counter()
    phases = (FORWARD, BACKWARD, WEIGHT) if sched.split_backward else (FORWARD, BACKWARD)
    for s in range(sched.num_stages):
        for i in range(sched.num_micro_batches):
            for phase in phases:
                want[Action(phase, s, i)] += 1
    got = collections.Counter()
    if len(sched.actions) != sched.num_devices:
        raise ValueError(
            f'{sched.name}: {len(sched.actions)} action lists for {sched.num_devices} devices.'
        )
    for d, acts in enumerate(sched.actions):
        for a in acts:
            if sched.device_of(a.stage) != d:
                raise ValueError(
                    f'{sched.name}: {a} is on device {d}, but stage {a.stage} runs on device '
                    f'{sched.device_of(a.stage)}.'
                )
            got[a] += 1
    missing, extra = want - got, got - want
    if missing or extra:
        raise ValueError(
            f'{sched.name}: missing actions {sorted(map(str, missing))[:6]}, unexpected or '
            f'repeated {sorted(map(str, extra))[:6]}.'
        )
    return simulate(sched)


@dataclasses.dataclass(frozen=True)
class Simulation:
    """A schedule run with per-action costs: when each action ran and what each device held."""

    times: dict  # action -> (start, end)
    makespan: float
    busy: tuple  # per device
    high_water: tuple  # per device: most micro-batches (stage, micro-batch pairs) stored at once

    @property
    def bubble(self):
        """Mean idle share of the devices over the step."""
        k = len(self.busy)
        return 1.0 - sum(self.busy) / (k * self.makespan) if self.makespan else 0.0


def simulate(sched, forward=1.0, backward=None, weight=None, transfer=None):
    """Runs the lists as a device would: in order, each action when its inputs exist.

    Costs default to F = 1, B = 2 (B = W = 1 when the backward is split); each may be one number
    for every stage or a sequence with one per stage (the planner's measured or predicted cell
    times). `transfer(dep, action)`: the seconds a dependency's result takes to reach an action
    on another device (it delays that action, not the sender). A stage-micro-batch is stored
    from its F until its last backward action (B, or W when split) ends.
    """
    if backward is None:
        backward = 1.0 if sched.split_backward else 2.0
    if weight is None:
        weight = 1.0
    per_stage = {}
    for phase, c in ((FORWARD, forward), (BACKWARD, backward), (WEIGHT, weight)):
        c = [float(c)] * sched.num_stages if isinstance(c, (int, float)) else list(c)
        if len(c) != sched.num_stages:
            raise ValueError(f'{phase} costs: {len(c)} given for {sched.num_stages} stages.')
        per_stage[phase] = c

    def cost(a):
        return per_stage[a.phase][a.stage]

    times, pos = {}, [0] * sched.num_devices
    free_at = [0.0] * sched.num_devices
    total = sum(len(a) for a in sched.actions)
    while len(times) < total:
        progressed = False
        for d, acts in enumerate(sched.actions):
            while pos[d] < len(acts):
                a = acts[pos[d]]
                deps = dependencies(sched, a)
                if not all(x in times for x in deps):
                    break
                ready = [
                    times[x][1]
                    + (transfer(x, a) if transfer and sched.device_of(x.stage) != d else 0.0)
                    for x in deps
                ]
                start = max([free_at[d]] + ready)
                times[a] = (start, start + cost(a))
                free_at[d] = start + cost(a)
                pos[d] += 1
                progressed = True
        if not progressed:
            stuck = [
                str(acts[pos[d]]) for d, acts in enumerate(sched.actions) if pos[d] < len(acts)
            ]
            raise ValueError(
                f'{sched.name}: deadlock — each device waits on an action that never runs; '
                f'next actions: {stuck}.'
            )
    last = WEIGHT if sched.split_backward else BACKWARD
    high = []
    for acts in sched.actions:
        stored = peak = 0
        for a in acts:  # a device's own order decides what it stores
            if a.phase == FORWARD:
                stored += 1
                peak = max(peak, stored)
            elif a.phase == last:
                stored -= 1
        high.append(peak)
    busy = tuple(sum(cost(a) for a in acts) for acts in sched.actions)
    makespan = max(end for _, end in times.values())
    return Simulation(times, makespan, busy, tuple(high))


def execution_order(sched):
    """All actions in one order that respects every dependency (by simulated start time, then
    device): the order the executor builds them in, so eager mode runs them in a valid order."""
    times = simulate(sched).times
    return sorted(times, key=lambda a: (times[a][0], sched.device_of(a.stage), a.phase))


def bubble_fraction(num_devices, num_micro_batches, virtual_stages=1):
    """Ideal idle share of fill-drain and 1F1B (interleaved: v times less):
    (K-1) / (v*M + K-1)."""
    k, m, v = num_devices, num_micro_batches, virtual_stages
    return (k - 1) / (v * m + k - 1)


def _check_positive(**values):
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f'{name} must be a positive int, got {value!r}.')
