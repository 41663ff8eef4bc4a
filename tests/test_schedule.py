"""The GPipe schedule, pinned for small K and M."""

import pytest

from tf_gpipe.gpipe import schedule


def _short(actions):
    return [f'{a.clock}:{a.phase}{a.stage}.{a.micro_batch}' for a in actions]


def test_forward_wave_k2_m3():
    assert _short(schedule.forward_schedule(2, 3)) == [
        '0:F0.0',
        '1:F0.1', '1:F1.0',
        '2:F0.2', '2:F1.1',
        '3:F1.2',
    ]  # fmt: skip


def test_backward_wave_k2_m3():
    assert _short(schedule.backward_schedule(2, 3)) == [
        '4:B1.2',
        '5:B1.1', '5:B0.2',
        '6:B1.0', '6:B0.1',
        '7:B0.0',
    ]  # fmt: skip


def test_whole_step_k3_m2():
    assert _short(schedule.gpipe_schedule(3, 2)) == [
        '0:F0.0', '1:F0.1', '1:F1.0', '2:F1.1', '2:F2.0', '3:F2.1',
        '4:B2.1', '5:B2.0', '5:B1.1', '6:B1.0', '6:B0.1', '7:B0.0',
    ]  # fmt: skip


@pytest.mark.parametrize('k,m', [(1, 1), (1, 4), (4, 1), (3, 5), (4, 8)])
def test_invariants(k, m):
    actions = schedule.gpipe_schedule(k, m)
    assert len(actions) == 2 * k * m
    assert max(a.clock for a in actions) + 1 == 2 * (m + k - 1)
    done = {}
    for a in actions:
        done[(a.phase, a.stage, a.micro_batch)] = a.clock
    for s in range(k):
        for mb in range(m):
            f, b = done[('F', s, mb)], done[('B', s, mb)]
            if s:
                assert f > done[('F', s - 1, mb)]  # data flows forward
            if s < k - 1:
                assert b > done[('B', s + 1, mb)]  # gradients flow back
            assert b > f
    # One action per stage per clock; each stage runs forwards in order, backwards in reverse.
    for acts in schedule.per_stage(actions).values():
        clocks = [a.clock for a in acts]
        assert len(set(clocks)) == len(clocks)
        assert [a.micro_batch for a in acts] == list(range(m)) + list(reversed(range(m)))


def test_bubble_fraction():
    assert schedule.bubble_fraction(1, 8) == 0
    assert schedule.bubble_fraction(4, 8) == pytest.approx(3 / 11)


def test_bad_arguments():
    with pytest.raises(ValueError, match='num_micro_batches must be a positive int'):
        schedule.forward_schedule(2, 0)
