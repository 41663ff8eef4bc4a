"""Recompute really saves memory: peak bytes of a training step, measured by TF's allocator.

Runs tools/peak_memory.py in a fresh process (the BFC allocator must be chosen before TF
starts) on a deep FC stack whose activations dominate its weights.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The Results guide's peak-memory stack: a micro-batch's activations are 16 MiB.
_FC_32X256 = [
    '--layers=32',
    '--width=256',
    '--batch_size=4096',
    '--num_micro_batches=8',
    '--activation=RELU',
]


def _peak_memory(*args):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true', TF_CPP_MIN_LOG_LEVEL='2')
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, 'tools', 'peak_memory.py'), *args, '--json'],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])['rows']


@pytest.mark.idle
def test_recompute_cuts_peak_memory_to_well_under_half():
    rows = _peak_memory('--layers=24', '--width=128', '--batch_size=4096', '--num_micro_batches=8')
    rows = {r['recompute']: r for r in rows}
    activations = 24 * 4096 * 128 * 4
    # The plain step holds every layer's activations; 'never' keeps them all too.
    assert rows['-']['peak_bytes'] > 0.9 * activations
    assert rows['never']['ratio_to_plain'] > 0.8
    # K=1, M=8 with recompute: boundary input + one micro-batch's activations + gradients.
    assert rows['always']['ratio_to_plain'] < 0.4, rows
    assert rows['except_last']['ratio_to_plain'] < 0.4, rows


@pytest.mark.idle
def test_each_schedules_peak_follows_its_high_water_mark():
    """Kept activations: 1F1B stores one micro-batch at K=1 where fill-drain stores M, and the
    measured peaks of every schedule follow the validator's high-water marks (plus the B-to-W
    gradients of a split backward)."""
    args = (
        '--layers=12',
        '--width=128',
        '--batch_size=4096',
        # M=4: a micro-batch's activations (6 MiB) well above the allocator's step-to-step
        # noise (about 1 MiB here), which at M=8 made the fit a coin toss under load.
        '--num_micro_batches=4',
        '--activation=RELU',
        '--policies=never',
        '--schedules=gpipe,1f1b,interleaved_1f1b,zero_bubble',
    )
    runs = [{r['setting'].split()[0]: r for r in _peak_memory(*args)} for _ in range(2)]
    by = runs[0]
    assert by['1f1b']['high_water'] == 1 and by['gpipe']['high_water'] == 4
    # zero_bubble: one stored micro-batch, plus its gradients at the weights' uses from B to W.
    assert by['zero_bubble']['activation_units'] == 2
    assert by['1f1b']['peak_bytes'] <= 0.5 * by['gpipe']['peak_bytes'], by
    for name in ('interleaved_1f1b', 'zero_bubble'):
        # The executor's op order differs from process to process, and with it what the
        # allocator holds at the peak: interleaved_1f1b held about 2 MiB more (1.29-1.30 of
        # the prediction) in 2 of 6 runs on 2026-11-27 (one a fresh-clone CI run), 1.01-1.04
        # in the others. What the schedule needs is the lesser of two fresh runs; the bounds
        # are the same.
        ratio = min(run[name]['measured_vs_predicted'] for run in runs)
        assert 0.8 < ratio < 1.25, runs


@pytest.mark.idle
def test_the_tick_loop_carries_kept_micro_batches_without_copies():
    """A micro-batch kept across the tick loop's ticks costs what it costs the unrolled
    executor: its activations, not a copy of them nor of the cell's weights (the loop had
    packed both into one vector per micro-batch: 23-42 MiB more than the unrolled step at
    gpipe's peak here, where a micro-batch's activations are 16 MiB). About 10 MiB is left
    (docs/results.md, the tick loop's peak memory table)."""
    args = [*_FC_32X256, '--policies=never', '--schedules=gpipe']
    loop = {r['setting'].split()[0]: r for r in _peak_memory(*args, '--tick_loop')}
    unrolled = {r['setting'].split()[0]: r for r in _peak_memory(*args, '--notick_loop')}
    micro_batch = 32 * (4096 // 8) * 256 * 4
    assert loop['gpipe']['peak_bytes'] < unrolled['gpipe']['peak_bytes'] + micro_batch, (
        loop,
        unrolled,
    )


@pytest.mark.idle
def test_the_fprop_loops_run_one_action_at_a_time_per_device():
    """FProp under a tape on the forward and backward loops holds what the unrolled executor
    holds plus less than one micro-batch's activations (16 MiB here). Once their branches
    were unordered calls (unordered.py), a device's next tick had not waited for its current
    action: up to parallel_iterations forwards ran at once, 88 MiB against 31 unrolled."""
    args = [*_FC_32X256, '--policies=always']
    loop = _peak_memory(*args, '--tick_loop')[1]
    unrolled = _peak_memory(*args, '--notick_loop')[1]
    assert loop['setting'].startswith('pipeline') and loop['recompute'] == 'always', loop
    micro_batch = 32 * (4096 // 8) * 256 * 4
    assert loop['peak_bytes'] < unrolled['peak_bytes'] + micro_batch, (loop, unrolled)
