"""A max-plus model of the tick loop's pacing: how long a step takes when its table is built
with B costing `table_b` ticks (the library: 2) and messages read `delay` ticks old.

Each device's tick t starts when its own tick t - 1 and, for every device that sends it
messages, that device's tick t - delay are done (plus `tau`, a transfer), and lasts its
action's real cost (F = 1, B = 2 per unit of a stage's cost) plus `eps` (a tick's overhead).
One-off, for the engine guide's tick-table section: `python pacing_model.py` from a checkout.
"""

import itertools
import random

from tf_gpipe.gpipe import schedules


def table(sched, delay, table_b):
    """{action: tick} and the number of ticks, as tick_loop.TickLoop._Table builds them."""
    b = 1.0 if sched.split_backward else table_b
    cost = {schedules.FORWARD: 1.0, schedules.BACKWARD: b, schedules.WEIGHT: 1.0}
    sim = schedules.simulate(sched, 1.0, b, 1.0, transfer=lambda dep, _: delay - cost[dep.phase])
    return {a: int(round(t0)) for a, (t0, _) in sim.times.items()}, int(round(sim.makespan))


def makespan(sched, delay, table_b, stage_cost, eps, tau):
    ticks_of, ticks = table(sched, delay, table_b)
    k = sched.num_devices
    work = [[0.0] * k for _ in range(ticks)]
    real_b = 1.0 if sched.split_backward else 2.0
    for a, t in ticks_of.items():
        per = {schedules.FORWARD: 1.0, schedules.BACKWARD: real_b, schedules.WEIGHT: 1.0}[a.phase]
        work[t][sched.device_of(a.stage)] += per * stage_cost[a.stage]
    senders = {d: set() for d in range(k)}
    for s in range(sched.num_stages):
        for n in (s - 1, s + 1):
            if 0 <= n < sched.num_stages and sched.device_of(n) != sched.device_of(s):
                senders[sched.device_of(s)].add(sched.device_of(n))
    end = [[0.0] * k for _ in range(ticks)]
    for t in range(ticks):
        for d in range(k):
            start = end[t - 1][d] if t else 0.0
            if t >= delay:
                start = max([start] + [end[t - delay][e] + tau for e in senders[d]])
            end[t][d] = start + work[t][d] + eps
    return ticks, max(end[-1])


def main():
    rng = random.Random(0)
    print('| schedule | K | M | ticks (B = 2) | ticks (B = 1) | step (B = 1) / step (B = 2) |')
    print('|---|---|---|---|---|---|')
    for name, k, m in itertools.product(('gpipe', '1f1b', 'interleaved_1f1b'), (4, 8), (8, 32)):
        sched = schedules.build(name, k, m, 2 if name == 'interleaved_1f1b' else 1)
        ratios = []
        for trial in range(4):
            cost = [1.0 if trial == 0 else rng.uniform(0.5, 1.5) for _ in range(sched.num_stages)]
            for eps, tau in itertools.product((0.0, 0.05, 0.3), (0.0, 0.1, 0.3)):
                t2, old = makespan(sched, 2, 2.0, cost, eps, tau)
                t1, new = makespan(sched, 2, 1.0, cost, eps, tau)
                ratios.append(new / old)
        print(f'| {name} | {k} | {m} | {t2} | {t1} | {min(ratios):.3f}–{max(ratios):.3f} |')


if __name__ == '__main__':
    main()
