"""Planner: per-device memory and step time from FPropMeta and the schedule, nothing built."""

import pytest

from tf_gpipe import layers, planning
from tf_gpipe.gpipe import partition, schedules

# A device whose numbers make the arithmetic easy: 1 flop/s, an instant link.
UNIT = planning.Device('unit', 1 << 40, 1.0, float('inf'), 0.0)


def _stack(n=8, width=64):
    fc = layers.FCLayer.Params()
    return [fc.Copy().Set(name=f'fc{i}', input_dim=width, output_dim=width) for i in range(n)]


def test_weights_gradients_and_slots_per_device():
    p = planning.plan(_stack(), (32, 64), 2, 4, UNIT, optimizer_slots=2)
    per_layer = 64 * 64 + 64
    for stage in p.stages:
        assert stage.params == 4 * per_layer  # 8 equal layers over 2 devices
        assert stage.weights == stage.gradients == 4 * stage.params
        assert stage.slots == 2 * stage.weights  # Adam: two slots
    assert p.stages[0].layers == 'fc0 .. fc3 (4)' and p.stages[1].layers == 'fc4 .. fc7 (4)'


def test_stored_activations_follow_the_schedules_high_water_mark():
    sub, shape = _stack(), (64, 64)
    one_boundary = 64 * 64 * 4 // 8  # a cell's input, one of 8 micro-batches, float32
    gpipe = planning.plan(sub, shape, 2, 8, UNIT, 'gpipe', 'always')
    one_f = planning.plan(sub, shape, 2, 8, UNIT, '1f1b', 'always')
    assert gpipe.stages[0].stored_activations == 8 * one_boundary  # fill-drain keeps all M
    assert one_f.stages[0].stored_activations == 2 * one_boundary  # 1F1B: at most K
    assert one_f.stages[1].stored_activations == one_boundary
    never = planning.plan(sub, shape, 2, 8, UNIT, 'gpipe', 'never')
    assert never.stages[0].stored_activations == 8 * 4 * one_boundary  # every layer's output
    assert never.peak > gpipe.peak > one_f.peak


def test_step_time_is_the_simulated_schedule():
    sub, shape = _stack(), (64, 64)
    k, m = 2, 4
    p = planning.plan(sub, shape, k, m, UNIT, 'gpipe', 'never')
    forward = sum(meta.flops for meta in partition.layer_metas(sub[:4], shape)) / m
    assert p.step_seconds == pytest.approx((m + k - 1) * 3 * forward)  # F + B = 3F per slot
    assert p.bubble == pytest.approx(schedules.bubble_fraction(k, m))
    redo = planning.plan(sub, shape, k, m, UNIT, 'gpipe', 'always')
    assert redo.step_seconds == pytest.approx(p.step_seconds * 4 / 3)  # B recomputes F
    slow_link = planning.Device('slow', 1 << 40, 1.0, 1.0, 0.0)
    assert planning.plan(sub, shape, k, m, slow_link).step_seconds > redo.step_seconds


def test_recommendation_puts_what_fits_first_fastest_first():
    sub, shape = _stack(), (64, 64)
    plans = planning.recommend(sub, shape, 2, UNIT)
    assert all(p.fits(UNIT) for p in plans)
    speeds = [p.examples_per_second for p in plans]
    assert speeds == sorted(speeds, reverse=True)
    budget = min(p.peak for p in plans)
    small = planning.Device('small', budget, 1.0, float('inf'), 0.0)
    ranked = planning.recommend(sub, shape, 2, small)
    assert ranked[0].fits(small) and ranked[0].peak == budget and not ranked[-1].fits(small)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match='recompute must be one of'):
        planning.plan(_stack(), (8, 64), 2, 2, UNIT, recompute='sometimes')
    with pytest.raises(ValueError, match="did you mean '1f1b'"):
        planning.plan(_stack(), (8, 64), 2, 2, UNIT, schedule='1fb1')
    with pytest.raises(ValueError, match='larger than the batch'):
        planning.plan(_stack(), (8, 64), 2, 16, UNIT)
    with pytest.raises(ValueError, match='larger than the number of layers'):
        planning.plan(_stack(2), (8, 64), 4, 2, UNIT)
