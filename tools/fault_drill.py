"""Kill -9 a training run at random steps, restart it each time, and check nothing was lost.

    python tools/fault_drill.py --kills=5

Trains a tiny model (default lm.synthetic.TransformerLmTiny, K=4 on logical CPUs) once without
interruption, then again from scratch in another logdir, killing the trainer process with
SIGKILL at `--kills` random steps (about half of them right as a checkpoint is being written)
and restarting it with the same command after each kill. Reported: runs, kills, steps redone
(steps trained after the last checkpoint before each kill), checkpoints lost (a checkpoint that
was listed before a kill and is unreadable or gone after it without a newer one), and the
largest absolute difference between the final weights and optimizer state of the two runs.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from absl import app, flags  # noqa: E402

KILLS = flags.DEFINE_integer('kills', 5, 'SIGKILLs to deliver.')
MODEL = flags.DEFINE_string('model', 'lm.synthetic.TransformerLmTiny', 'Registered model.')
MAX_STEPS = flags.DEFINE_integer('max_steps', 60, 'Training steps of each run.')
SAVE_EVERY = flags.DEFINE_integer('save_interval_steps', 5, 'Checkpoint interval.')
CPUS = flags.DEFINE_integer('num_logical_cpus', 4, 'Logical CPUs of the trainer.')
SEED = flags.DEFINE_integer('seed', 0, 'Seed of the kill steps.')
WORKDIR = flags.DEFINE_string('workdir', None, 'Where the two logdirs go (default: a temp dir).')
TIMEOUT = flags.DEFINE_integer('run_timeout', 600, 'Seconds a trainer run may take.')
OVERRIDE = flags.DEFINE_string(
    'params_override', '', 'More overrides for every run, e.g. task.pipeline.num_micro_batches=2.'
)
JSON = flags.DEFINE_bool('json', False, 'Print JSON.')
OUTPUT = flags.DEFINE_string('output', '', 'Also write the JSON result (with run metadata) here.')

TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'trainer.py')
_STEP = re.compile(r'step\s+(\d+)\s+loss')


def _command(logdir):
    override = f'task.train.log_interval_steps=1; task.train.save_interval_steps={SAVE_EVERY.value}'
    if OVERRIDE.value:
        override += f'; {OVERRIDE.value}'
    return [
        sys.executable,
        TRAINER,
        f'--model={MODEL.value}',
        f'--logdir={logdir}',
        f'--num_logical_cpus={CPUS.value}',
        f'--max_steps={MAX_STEPS.value}',
        f'--params_override={override}',
    ]


def _start(logdir):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    return subprocess.Popen(
        _command(logdir), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )


def _run_to_end(logdir):
    proc = _start(logdir)
    _, err = proc.communicate(timeout=TIMEOUT.value)
    if proc.returncode != 0:
        raise RuntimeError(f'trainer failed (exit {proc.returncode}):\n{err[-3000:]}')


def _run_and_kill(logdir, kill_step):
    """Starts the trainer and SIGKILLs it once it logs `kill_step`; the step it reached."""
    proc = _start(logdir)
    deadline = time.time() + TIMEOUT.value
    reached = None
    for line in proc.stderr:
        match = _STEP.search(line)
        if match:
            reached = int(match.group(1))
            if reached >= kill_step:
                proc.send_signal(signal.SIGKILL)
                break
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError('trainer run timed out')
    proc.wait()
    if reached is None or reached < kill_step:
        raise RuntimeError(f'trainer ended before step {kill_step} (exit {proc.returncode})')
    return reached


def checkpoints(logdir):
    """{step: readable?} of the checkpoints the logdir's state file lists."""
    import tensorflow as tf

    state = tf.train.get_checkpoint_state(os.path.join(logdir, 'checkpoints'))
    out = {}
    for path in state.all_model_checkpoint_paths if state else []:
        step = int(path.rsplit('-', 1)[1])
        try:
            reader = tf.train.load_checkpoint(path)
            for name in reader.get_variable_to_shape_map():
                reader.get_tensor(name)
            out[step] = True
        except Exception:
            out[step] = False
    return out


def final_state(logdir):
    """{variable name: array} of the latest checkpoint (model, optimizer, step)."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(logdir, 'checkpoints'))
    return {
        name: reader.get_tensor(name)
        for name in reader.get_variable_to_shape_map()
        if not name.startswith('_CHECKPOINTABLE_OBJECT_GRAPH')
    }


def max_deviation(a, b):
    import numpy as np

    if sorted(a) != sorted(b):
        raise RuntimeError(f'the runs saved different variables: {sorted(set(a) ^ set(b))[:5]}')
    devs = [
        float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64))))
        for k in a
        if getattr(a[k], 'dtype', None) is not None and a[k].dtype.kind in 'fiu' and a[k].size
    ]
    return max(devs)


def drill(workdir, kills, seed):
    rng = random.Random(seed)
    reference, drilled = os.path.join(workdir, 'reference'), os.path.join(workdir, 'drill')
    for d in (reference, drilled):
        shutil.rmtree(d, ignore_errors=True)
    start = time.time()
    _run_to_end(reference)
    runs, redone, lost, kill_log = 1, 0, 0, []
    last_saved = 0
    for _ in range(kills):
        first = last_saved + 1
        if first >= MAX_STEPS.value:
            break
        candidates = list(range(first, MAX_STEPS.value))
        saves = [s for s in candidates if s % SAVE_EVERY.value == 0]
        # Half the kills land just as a checkpoint is being written.
        kill_step = rng.choice(saves) if saves and rng.random() < 0.5 else rng.choice(candidates)
        before = {s for s, ok in checkpoints(drilled).items() if ok} if runs > 1 else set()
        reached = _run_and_kill(drilled, kill_step)
        runs += 1
        after = checkpoints(drilled)
        readable = {s for s, ok in after.items() if ok}
        newest = max(readable, default=0)
        # Lost: listed and readable before the kill, now unreadable or gone with nothing newer.
        lost += sum(1 for s in before if s not in readable and s >= newest)
        redone += reached - newest
        kill_log.append(dict(kill_at=reached, last_checkpoint=newest))
        last_saved = newest
    _run_to_end(drilled)
    runs += 1
    deviation = max_deviation(final_state(reference), final_state(drilled))
    return dict(
        model=MODEL.value,
        max_steps=MAX_STEPS.value,
        save_interval_steps=SAVE_EVERY.value,
        runs=runs,
        kills=len(kill_log),
        steps_redone=redone,
        checkpoints_lost=lost,
        max_weight_deviation=deviation,
        kill_log=kill_log,
        seconds=time.time() - start,
    )


def main(_):
    workdir = WORKDIR.value or tempfile.mkdtemp(prefix='fault_drill_')
    r = drill(workdir, KILLS.value, SEED.value)
    if OUTPUT.value:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_common import run_metadata, write_json

        write_json(OUTPUT.value, dict(r, **run_metadata()))
    if JSON.value:
        print(json.dumps(r))
        return
    print(
        f'{r["model"]}: {r["max_steps"]} steps, a checkpoint every {r["save_interval_steps"]}; '
        f'SIGKILL at random steps, restarted with the same command'
    )
    for k in r['kill_log']:
        print(f'  killed at step {k["kill_at"]:>4}; resumed from checkpoint {k["last_checkpoint"]}')
    print(
        f'runs {r["runs"]}  kills {r["kills"]}  steps redone {r["steps_redone"]}  checkpoints '
        f'lost {r["checkpoints_lost"]}  final-weight deviation {r["max_weight_deviation"]:.2e}  '
        f'({r["seconds"]:.0f} s)'
    )


if __name__ == '__main__':
    app.run(main)
