"""Planner: per-device memory and step time from FPropMeta and the schedule, nothing built."""

import json
import os
import subprocess
import sys

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
    sub, shape = _stack(), (4096, 64)  # activations well above the weights and their gradients
    one_boundary = 4096 * 64 * 4 // 8  # a cell's input, one of 8 micro-batches, float32
    gpipe = planning.plan(sub, shape, 2, 8, UNIT, 'gpipe', 'always')
    one_f = planning.plan(sub, shape, 2, 8, UNIT, '1f1b', 'always')
    # Device 1 stores the inputs it receives; device 0's are the batch's slices (its `inputs`).
    assert gpipe.stages[1].stored_activations == 8 * one_boundary  # fill-drain keeps all M
    assert one_f.stages[1].stored_activations == one_boundary  # 1F1B: at most K - d
    assert gpipe.stages[0].stored_activations == 0
    assert gpipe.stages[0].inputs == 2 * 4096 * 64 * 4 and gpipe.stages[1].inputs == 0
    never = planning.plan(sub, shape, 2, 8, UNIT, 'gpipe', 'never')
    assert never.stages[1].stored_activations == 8 * 5 * one_boundary  # its input + 4 outputs
    assert never.stages[1].peak > gpipe.stages[1].peak > one_f.stages[1].peak
    # A split backward also holds, between B and W, the gradients at the weights' uses.
    zb = planning.plan(sub, shape, 2, 8, UNIT, 'zero_bubble', 'never')
    assert zb.stages[1].stored_activations > one_f.stages[1].stored_activations


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


def test_per_stage_costs_and_transfers_in_the_simulation():
    sched = schedules.build('gpipe', 2, 2)
    sim = schedules.simulate(sched, [1.0, 3.0], [2.0, 6.0])
    # Stage 1 is the bottleneck: F1 x2 then B1 x2 back to back after the first F0.
    assert sim.makespan == 1 + 3 + 3 + 6 + 6 + 2
    hop = schedules.simulate(sched, [1.0, 3.0], [2.0, 6.0], transfer=lambda dep, a: 0.5)
    assert hop.makespan == sim.makespan + 2 * 0.5  # one hop forward, one back on the path
    with pytest.raises(ValueError, match='3 given for 2 stages'):
        schedules.simulate(sched, [1.0, 1.0, 1.0])


def test_measured_layer_times_drive_the_step_time():
    sub, shape = _stack(4), (16, 64)
    seconds = [(1.0, 2.0), (1.0, 2.0), (3.0, 6.0), (3.0, 6.0)]
    p = planning.plan(sub, shape, 2, 4, UNIT, 'gpipe', 'never', layer_seconds=seconds)
    # Cells of two layers each: stage 1 takes 6 + 12 per micro-batch and sets the pace.
    assert p.step_seconds == pytest.approx(2 + 4 * 6 + 4 * 12 + 4)
    with pytest.raises(ValueError, match='3 entries for 4 layers'):
        planning.plan(sub, shape, 2, 4, UNIT, layer_seconds=seconds[:3])


def test_largest_finds_the_last_model_that_fits():
    def make(knob):
        return _stack(knob), (32, 64)

    fits_8 = planning.plan(*make(8), 1, 1, UNIT, 'gpipe', 'never').peak
    fits_9 = planning.plan(*make(9), 1, 1, UNIT, 'gpipe', 'never').peak
    budget = planning.Device('budget', (fits_8 + fits_9) // 2, 1.0, float('inf'), 0.0)
    knob, p = planning.largest(make, 1, budget, [(1, 'gpipe', 'never')])
    assert knob == 8 and p.peak == fits_8
    # Two devices hold about twice the layers.
    knob2, _ = planning.largest(make, 2, budget, [(1, 'gpipe', 'never')], start=2)
    assert 15 <= knob2 <= 18


def test_device_profiles_and_names():
    assert planning.get('tpu-v2').memory_bytes == 8 * planning.GIB
    with pytest.raises(ValueError, match="did you mean 'a100-40gb'"):
        planning.get('a100-40')


@pytest.mark.idle
def test_predicted_peak_memory_is_within_15_percent_of_the_allocators():
    """The memory model against TF's BFC allocator on small K=1 cases (each in a fresh
    process): kept activations under fill-drain and 1F1B, a Transformer under recompute."""
    configs = [
        'fc:8:1024:1:1:gpipe:never',
        'fc:8:1024:1:4:1f1b:never',
        'transformer:2:32:1:4:gpipe:always',
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, os.path.join(root, 'tools', 'plan_check.py'), '--local', '--json',
         f'--configs={",".join(configs)}'],
        capture_output=True, text=True, timeout=300, check=True,
        env=dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true'),
    )  # fmt: skip
    rows = json.loads(out.stdout.strip().splitlines()[-1])['rows']
    assert [r['config'] for r in rows] == configs
    for r in rows:
        measured, predicted = r['measured_peak_bytes'][0], r['predicted']['peak_bytes'][0]
        assert 0.85 < measured / predicted < 1.15, (r['config'], measured, predicted)
