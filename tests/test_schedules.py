"""Schedules as data: each schedule's action lists pinned for small K and M, the validator's
checks, and the simulated bubble and high-water marks against their formulas."""

import pytest

from tf_gpipe.gpipe import schedules


def _lists(sched):
    return [' '.join(str(a) for a in acts) for acts in sched.actions]


def test_gpipe_k2_m3():
    assert _lists(schedules.build('gpipe', 2, 3)) == [
        'F0.0 F0.1 F0.2 B0.2 B0.1 B0.0',
        'F1.0 F1.1 F1.2 B1.2 B1.1 B1.0',
    ]


def test_1f1b_k3_m4():
    assert _lists(schedules.build('1f1b', 3, 4)) == [
        'F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3',
        'F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3',
        'F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3',
    ]


def test_interleaved_k2_m4_v2():
    # Device d holds stages d and d + 2; micro-batches go through each chunk in groups of 2.
    assert _lists(schedules.build('interleaved_1f1b', 2, 4, virtual_stages=2)) == [
        'F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3',
        'F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3',
    ]


def test_zero_bubble_k2_m4():
    assert _lists(schedules.build('zero_bubble', 2, 4)) == [
        'F0.0 F0.1 B0.0 W0.0 B0.1 F0.2 W0.1 F0.3 B0.2 W0.2 B0.3 W0.3',
        'F1.0 B1.0 F1.1 B1.1 W1.0 W1.1 F1.2 B1.2 F1.3 B1.3 W1.2 W1.3',
    ]


CASES = [(1, 1), (1, 4), (2, 1), (2, 4), (3, 5), (4, 8), (4, 2), (5, 16)]


@pytest.mark.parametrize('k,m', CASES)
def test_fill_drain_and_1f1b_bubble_and_memory(k, m):
    bound = schedules.bubble_fraction(k, m)
    gp = schedules.validate(schedules.build('gpipe', k, m))
    ob = schedules.validate(schedules.build('1f1b', k, m))
    assert gp.bubble == pytest.approx(bound) and ob.bubble == pytest.approx(bound)
    assert gp.high_water == (m,) * k  # fill-drain stores every micro-batch
    assert ob.high_water == tuple(min(m, k - d) for d in range(k))  # 1F1B: at most K - d


@pytest.mark.parametrize('k,m', CASES)
def test_zero_bubble_beats_1f1b_at_its_memory(k, m):
    zb = schedules.validate(schedules.build('zero_bubble', k, m))
    ob = schedules.simulate(schedules.build('1f1b', k, m), 1, 2)  # B = input + weight gradient
    assert max(zb.high_water) <= max(ob.high_water)  # ZB-H1: 1F1B's peak
    assert zb.makespan <= ob.makespan
    if k > 1 and m >= k:
        assert zb.makespan < ob.makespan
    # The paper's ZB-H1 makespan 3M + K - 1 (unit costs), within K - 1.
    assert 3 * m + k - 1 <= zb.makespan <= 3 * m + 2 * (k - 1)


@pytest.mark.parametrize('k,m,v', [(2, 2, 2), (2, 4, 2), (4, 8, 2), (3, 9, 3), (4, 4, 4)])
def test_interleaved_divides_the_bubble(k, m, v):
    sim = schedules.validate(schedules.build('interleaved_1f1b', k, m, virtual_stages=v))
    assert sim.bubble == pytest.approx(schedules.bubble_fraction(k, m, v))
    assert sim.bubble < schedules.bubble_fraction(k, m)
    assert sim.high_water == tuple(min(v * m, 2 * (k - d - 1) + (v - 1) * k + 1) for d in range(k))


@pytest.mark.parametrize('name', schedules.SCHEDULES)
def test_execution_order_respects_every_dependency(name):
    sched = schedules.build(name, 3, 6, virtual_stages=2 if name == 'interleaved_1f1b' else 1)
    order = schedules.execution_order(sched)
    seen = set()
    for a in order:
        assert all(d in seen for d in schedules.dependencies(sched, a)), a
        seen.add(a)
    for acts in sched.actions:  # and each device's own order
        assert [a for a in order if a in set(acts)] == list(acts)


def test_validator_finds_deadlock_and_missing_actions():
    good = schedules.build('gpipe', 2, 2)
    swapped = schedules.Schedule(
        'bad', 2, 2, 2, (good.actions[0], tuple(reversed(good.actions[1]))), False
    )
    with pytest.raises(ValueError, match='deadlock'):
        schedules.validate(swapped)
    short = schedules.Schedule('bad', 2, 2, 2, (good.actions[0][:-1], good.actions[1]), False)
    with pytest.raises(ValueError, match=r'missing actions \[.B0.0.\]'):
        schedules.validate(short)
    wrong = schedules.Schedule('bad', 2, 2, 2, (good.actions[1], good.actions[0]), False)
    with pytest.raises(ValueError, match='stage 1 runs on device 1'):
        schedules.validate(wrong)


def test_bad_arguments():
    with pytest.raises(ValueError, match="did you mean '1f1b'"):
        schedules.build('1fb1', 2, 4)
    with pytest.raises(ValueError, match='num_micro_batches must be a positive int'):
        schedules.build('gpipe', 2, 0)
    with pytest.raises(ValueError, match='must be a multiple of 2'):
        schedules.build('interleaved_1f1b', 2, 3, virtual_stages=2)
    with pytest.raises(ValueError, match="needs schedule='interleaved_1f1b'"):
        schedules.build('1f1b', 2, 4, virtual_stages=2)
