"""Recompute really saves memory: peak bytes of a training step, measured by TF's allocator.

Runs tools/peak_memory.py in a fresh process (the BFC allocator must be chosen before TF
starts) on a deep FC stack whose activations dominate its weights.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_recompute_cuts_peak_memory_to_well_under_half():
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true', TF_CPP_MIN_LOG_LEVEL='2')
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, 'tools', 'peak_memory.py'),
            '--layers=24',
            '--width=128',
            '--batch_size=4096',
            '--num_micro_batches=8',
            '--json',
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    rows = {r['recompute']: r for r in json.loads(out.stdout.strip().splitlines()[-1])['rows']}
    activations = 24 * 4096 * 128 * 4
    # The plain step holds every layer's activations; 'never' keeps them all too.
    assert rows['-']['peak_bytes'] > 0.9 * activations
    assert rows['never']['ratio_to_plain'] > 0.8
    # K=1, M=8 with recompute: boundary input + one micro-batch's activations + gradients.
    assert rows['always']['ratio_to_plain'] < 0.4, rows
    assert rows['except_last']['ratio_to_plain'] < 0.4, rows
