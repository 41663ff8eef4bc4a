"""The continuous evaler (Lingvo's evaler_test job): every new checkpoint evaluated once, in
order, until the trainer's final step; resumable; bounded waiting; beside a running trainer."""

import glob
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tf_gpipe import hyperparams, model_registry
from tf_gpipe.trainer import evaler, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = 'lm.synthetic.TransformerLmTiny'
FAST = (
    'task.pipeline.num_partitions=2; task.pipeline.num_micro_batches=2; '
    'task.train.save_interval_steps=2; task.train.log_interval_steps=2; task.eval.steps=2'
)


def _params(max_steps):
    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    model = model_registry.GetClass(MODEL)()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test(), model.Dev())
    hyperparams.apply_overrides(p, f'{FAST}; task.train.max_steps={max_steps}')
    return p


def _steps(event_dir, tag='loss'):
    steps = []
    for path in glob.glob(os.path.join(event_dir, 'events.*')):
        for event in tf.compat.v1.train.summary_iterator(path):
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return sorted(steps)


def test_each_checkpoint_once_in_order_resumable_and_bounded(tmp_path):
    logdir = str(tmp_path / 'run')
    trainer.Trainer(_params(2), logdir).Train()  # checkpoint 2; the run goes to 4
    sleeps = []
    with pytest.raises(TimeoutError, match=r'no checkpoint after step 2 .* to step 4'):
        evaler.run(trainer.Trainer(_params(4), logdir), 0.01, 0.05, sleep=sleeps.append)
    assert sleeps and evaler.evaluated_step(logdir) == 2
    trainer.Trainer(_params(4), logdir).Train()  # checkpoint 4, the final one
    results = evaler.run(trainer.Trainer(_params(4), logdir), 0.01, 60)
    assert sorted(results) == [4]  # 2 was done before the restart
    assert _steps(evaler.job_dir(logdir)) == [2, 4]  # one point per checkpoint
    assert len(glob.glob(os.path.join(evaler.job_dir(logdir), 'events.*'))) == 2  # one per run
    assert evaler.run(trainer.Trainer(_params(4), logdir), 0.01, 0.05) == {}  # nothing left
    # evaler_dev: the same checkpoints on the params class's Dev() input, its own run and state.
    t = trainer.Trainer(_params(4), logdir)
    dev = evaler.run(t, 0.01, 60, 'eval_dev', lambda p, w: t.EvaluateCheckpoint(p, w, 'dev'))
    assert sorted(dev) == [2, 4] and _steps(evaler.job_dir(logdir, 'eval_dev')) == [2, 4]
    assert dev[4] != results[4]  # another data set
    without = _params(4)
    without.dev = None
    with pytest.raises(ValueError, match='has no dev input'):
        trainer.Trainer(without, logdir).EvaluateCheckpoint(None, None, 'dev')


def test_evaler_job_beside_a_running_trainer(tmp_path):
    """Lingvo's --job names: the evaler starts first, waits, and evaluates what the trainer
    writes as it writes it, through the final step."""
    logdir = str(tmp_path / 'run')
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    common = [f'--model={MODEL}', f'--logdir={logdir}', f'--params_override={FAST}']
    script = os.path.join(ROOT, 'tools', 'trainer.py')
    os.makedirs(logdir)
    evaling = subprocess.Popen(
        [sys.executable, script, '--job=evaler_test', '--max_steps=6', '--num_logical_cpus=2',
         '--evaler_poll_seconds=0.5', '--evaler_timeout=300', *common],
        stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        training = subprocess.run(
            [sys.executable, script, '--job=trainer', '--max_steps=6', '--num_logical_cpus=2',
             *common],
            capture_output=True, text=True, timeout=400, env=env, cwd=ROOT,
        )  # fmt: skip
        assert training.returncode == 0, training.stderr[-3000:]
        _, err = evaling.communicate(timeout=400)
    finally:
        evaling.kill()
    assert evaling.returncode == 0, err[-3000:]
    assert 'evaluated up to the final step 6' in err
    assert _steps(evaler.job_dir(logdir))[-1] == 6
    assert set(_steps(evaler.job_dir(logdir))) <= {2, 4, 6}
