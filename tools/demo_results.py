"""The demos' figures, measured: the demo table in docs/getting-started.md come from this tool's file.

    python tools/demo_results.py      # writes docs/results/demos.json (about 2 minutes)

Trains each demo model as `make demo` does (its params class's K, M and schedule on 4 logical
CPUs, train_and_eval) and records the loss at the first and last step, the final eval accuracy,
the first step's seconds (tracing included), steps/s and examples/s after it, and for the
translation model the BLEU of beam search on its test batches. Then the decoding speed of the
first test batch (translation: beam search of 4; language model: sampling the second half of
each sequence), with the attention caches and by recomputing the prefix, in tokens/s: one
warm-up run (the traces), then the median, least and most of DECODE_RUNS runs. One training run
each: the figures of one machine at one time, as the file's metadata says.

The first step as `make demo` meets it is also timed in --first_step_runs fresh processes per
demo (`tools/trainer.py --mode=train`, one step, the "First step done in" line of its log):
the median, least and most, since a first step varies from process to process by a second.
"""

import glob
import os
import re
import subprocess
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OUT = flags.DEFINE_string('out', 'docs/results/demos.json', 'Result file.')
STEPS_SCALE = flags.DEFINE_float(
    'steps_scale', 1.0, "Train steps = each demo's steps times this (a quick check: 0.02)."
)
DECODE_RUNS = 5
FIRST_STEP_RUNS = flags.DEFINE_integer(
    'first_step_runs', 5, 'Fresh trainer processes per demo that time its first step.'
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMOS = (('lm.synthetic.TransformerLmTiny', 300), ('mt.synthetic.TransformerNmtTiny', 400))


def _losses(event_dir):
    import tensorflow as tf

    out = []
    for path in glob.glob(os.path.join(event_dir, 'events.*')):
        for event in tf.compat.v1.train.summary_iterator(path):
            out += [
                (event.step, float(tf.make_ndarray(v.tensor)))
                for v in event.summary.value
                if v.tag == 'loss'
            ]
    return sorted(out)


def run_demo(key, steps, logdir):
    from tf_gpipe import hyperparams, model_registry
    from tf_gpipe.trainer import decoder, trainer

    model = model_registry.GetClass(key)()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    hyperparams.apply_overrides(p, f'task.train.max_steps={steps}')
    t = trainer.Trainer(p, logdir)
    start = time.time()
    last = t.Train(eval_too=True)
    wall = time.time() - start
    losses = _losses(os.path.join(logdir, 'train'))
    evals = t.Evaluate()
    row = dict(
        model=key,
        num_partitions=p.task.pipeline.num_partitions,
        num_micro_batches=p.task.pipeline.num_micro_batches,
        schedule=p.task.pipeline.schedule,
        steps=steps,
        first_loss=losses[0][1],
        last_loss=losses[-1][1],
        eval_accuracy=evals['accuracy'],
        first_step_s=t.first_step_seconds,
        steps_per_sec=(steps - 1) / max(wall - t.first_step_seconds, 1e-9),
        examples_per_sec=last['examples_per_sec'],
        wall_s=wall,
    )
    if key.startswith('mt.'):
        row['bleu'] = decoder.run(t, beam_size=4)['bleu']
    row['decode_tokens_per_sec'] = decode_speed(t, key)
    return row


def first_step_in_fresh_processes(key, runs):
    """{median, min, max, runs}: the first step's seconds (tracing included) that `make demo`
    logs, each run a new trainer process training one step in a new logdir."""
    import numpy as np

    seconds = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as logdir:
            command = [
                sys.executable,
                os.path.join(ROOT, 'tools', 'trainer.py'),
                f'--model={key}',
                f'--logdir={logdir}',
                '--num_logical_cpus=4',
                '--mode=train',
                '--params_override=task.train.max_steps=1',
            ]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
            found = re.search(r'First step done in ([0-9.]+) s', done.stderr)
            if done.returncode or not found:
                raise RuntimeError(f'{" ".join(command)} failed:\n{done.stderr[-3000:]}')
            seconds.append(float(found.group(1)))
    seconds.sort()
    return dict(median=float(np.median(seconds)), min=seconds[0], max=seconds[-1], runs=runs)


def decode_speed(t, key):
    """{mode: {median, min, max}} tokens/s of decoding the first test batch."""
    import numpy as np

    from tf_gpipe.tasks import decoding

    b = t.test_input.GetBatch(0)
    if key.startswith('mt.'):
        args = (t.task, b.src_ids, b.src_paddings, b.tgt_ids.numpy()[:, 0], b.tgt_ids.shape[1])

        def run(incremental):
            return decoding.beam_search(*args, beam_size=4, incremental=incremental)
    else:
        ids = b.ids.numpy()

        def run(incremental):
            prefix = ids[:, : ids.shape[1] // 2]
            return decoding.sample(t.task, prefix, ids.shape[1], top_k=4, incremental=incremental)

    out = {'runs': DECODE_RUNS}
    for mode, incremental in (('incremental', True), ('recompute', False)):
        assert run(incremental).incremental == incremental
        rates = sorted(run(incremental).tokens_per_sec for _ in range(DECODE_RUNS))
        out[mode] = dict(median=float(np.median(rates)), min=rates[0], max=rates[-1])
    return out


def main(argv):
    del argv
    from tf_gpipe.runtime import cluster

    cluster.logical_cpus(4)
    from bench_common import run_metadata, write_json

    from tf_gpipe import model_registry

    model_registry.LoadParamsDir(os.path.join(os.path.dirname(__file__), '..', 'params'))
    rows = []
    for key, steps in DEMOS:
        with tempfile.TemporaryDirectory() as logdir:
            steps = max(2, round(steps * STEPS_SCALE.value))
            rows.append(run_demo(key, steps, os.path.join(logdir, 'run')))
        rows[-1]['first_step_fresh_s'] = first_step_in_fresh_processes(key, FIRST_STEP_RUNS.value)
        print(rows[-1], flush=True)
    write_json(OUT.value, dict(demos=rows, **run_metadata()))


if __name__ == '__main__':
    app.run(main)
