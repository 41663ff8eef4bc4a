"""Reliability: exact resume after kill -9, graceful stop, divergence, bad checkpoints and input."""

import glob
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe import hyperparams, model_registry
from tf_gpipe.trainer import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = 'lm.synthetic.TransformerLmTiny'
# The demo model at K=2, M=2: the same machinery, half the graph to trace in every run.
_LIGHT = 'task.pipeline.num_partitions=2; task.pipeline.num_micro_batches=2'
model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))


def _params(overrides='', key=MODEL):
    model = model_registry.GetClass(key)()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    hyperparams.apply_overrides(p, f'task.train.log_interval_steps=1; {_LIGHT}; {overrides}')
    return p


def _env():
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')


def test_fault_drill_kill_9_resumes_exactly(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, 'tools', 'fault_drill.py'),
            '--kills=1',
            '--max_steps=12',
            '--save_interval_steps=4',
            '--seed=3',
            f'--params_override={_LIGHT}',
            f'--workdir={tmp_path}',
            '--json',
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.splitlines()[-1])
    assert r['kills'] == 1 and r['runs'] == 3
    assert r['checkpoints_lost'] == 0
    assert r['max_weight_deviation'] <= 1e-6
    # At most the steps since the last checkpoint are redone.
    assert r['steps_redone'] == sum(k['kill_at'] - k['last_checkpoint'] for k in r['kill_log'])
    assert all(k['kill_at'] - k['last_checkpoint'] <= 4 for k in r['kill_log'])


def test_a_stop_signal_saves_the_step_and_returns(tmp_path, caplog):
    """SIGTERM (what a scheduler sends) or SIGINT (Ctrl-C) during Train() ends the loop after
    the current step, saves it and returns, so the tool exits 0; rerunning resumes from it (the
    fault drill and test_trainer resume tool runs). In-process: the handler is the library's."""
    import threading

    assert threading.current_thread() is threading.main_thread()  # where handlers can be set
    t = trainer.Trainer(_params('task.train.max_steps=100000'), str(tmp_path))
    t.Build()
    step_fn = t._train_step
    installed = []

    def step_then_sigterm():
        out = step_fn()
        if int(t.global_step.numpy()) == 3:
            installed.extend(signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT))
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    step_then_sigterm.experimental_get_tracing_count = step_fn.experimental_get_tracing_count
    step_then_sigterm.get_concrete_function = step_fn.get_concrete_function
    t._train_step = step_then_sigterm
    # What SIGINT did before: Python's default, or ignored (a job started in the background by a
    # non-interactive shell inherits SIGINT ignored).
    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    # absl's logger too: an earlier test in this process may have pinned its level (TF's
    # saved_model.save sets absl's verbosity explicitly), which would drop the INFO line.
    with caplog.at_level('INFO'), caplog.at_level('INFO', logger='absl'):
        t.Train()
    assert int(t.global_step) == 3 and t.manager.latest_checkpoint.endswith('ckpt-3')
    message = [r.getMessage() for r in caplog.records if 'Received SIGTERM' in r.getMessage()]
    assert message and 'at step 3: saved' in message[0] and 'Run the same command' in message[0]
    # Both signals had the same handler (the library's) during the loop; restored after.
    assert installed[0] == installed[1] and installed[1] not in before
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def _finite_checkpoint(path):
    reader = tf.train.load_checkpoint(path)
    for name in reader.get_variable_to_shape_map():
        value = reader.get_tensor(name)
        if isinstance(value, np.ndarray) and value.dtype.kind == 'f':
            assert np.isfinite(value).all(), name


# An absurd learning rate, unclipped: the loss becomes NaN/Inf within a few steps.
_DIVERGE = (
    'task.train.learner.learning_rate=1e30; task.train.learner.warmup_steps=0; '
    'task.train.learner.clip_gradient_norm=0.0; '
)


def test_divergence_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    p = _params(_DIVERGE + 'task.train.save_interval_steps=1; task.train.max_steps=50')
    t = trainer.Trainer(p, str(tmp_path))
    with pytest.raises(FloatingPointError, match=r'Training diverged at step (\d+)') as info:
        t.Train()
    message = str(info.value)
    step = int(message.split('at step ')[1].split(':')[0])
    assert 'nonfinite_policy=skip' in message and 'Lower the learning rate' in message
    saved = sorted(int(p.rsplit('-', 1)[1]) for p in t.manager.checkpoints)
    assert saved and max(saved) == step - 1  # the bad step was never saved
    for path in t.manager.checkpoints:
        _finite_checkpoint(path)


def test_divergent_steps_can_be_skipped_and_counted(tmp_path):
    p = _params(_DIVERGE + 'task.train.nonfinite_policy=skip; task.train.max_steps=6')
    t = trainer.Trainer(p, str(tmp_path))
    last = t.Train()
    assert last['nonfinite_steps'] >= 1 and int(t.global_step) == 6
    for v in t.task.trainable_variables:
        assert np.isfinite(v.numpy()).all(), v.name  # a skipped step changes nothing
    _finite_checkpoint(t.manager.latest_checkpoint)
    with pytest.raises(ValueError, match="nonfinite_policy must be one of \\('stop', 'skip'\\)"):
        trainer.Trainer(_params('task.train.nonfinite_policy=ignore'), str(tmp_path / 'x')).Build()


def test_unreadable_newest_checkpoint_falls_back_and_foreign_is_refused(tmp_path, caplog):
    logdir = str(tmp_path)
    p = _params('task.train.save_interval_steps=3; task.train.max_steps=6')
    trainer.Trainer(p, logdir).Train()
    ckpts = f'{logdir}/checkpoints'
    # A crash in the middle of writing ckpt-9: data written, the state file not yet updated.
    with open(f'{ckpts}/ckpt-9.data-00000-of-00001', 'wb') as f:
        f.write(b'partial')
    # And the newest listed checkpoint corrupted on disk.
    (data,) = glob.glob(f'{ckpts}/ckpt-6.data-*')
    with open(data, 'r+b') as f:
        f.truncate(100)
    resumed = trainer.Trainer(_params('task.train.max_steps=8'), logdir)
    with caplog.at_level('WARNING'):
        assert resumed.Restore().endswith('ckpt-3')
    assert int(resumed.global_step) == 3
    assert any('ckpt-6 is unreadable' in r.getMessage() for r in caplog.records)
    resumed.Train()
    assert int(resumed.global_step) == 8
    foreign = trainer.Trainer(_params(key='mt.synthetic.TransformerNmtTiny'), logdir)
    with pytest.raises(RuntimeError, match='is of another model'):
        foreign.Restore()


def test_bad_settings_fail_clearly(tmp_path):
    not_a_dir = tmp_path / 'file'
    not_a_dir.write_text('x')
    with pytest.raises(RuntimeError, match='Cannot write to logdir .* Pass a --logdir'):
        trainer.Trainer(_params(), str(not_a_dir / 'logdir')).Build()
    with pytest.raises(ValueError, match="Unknown schedule '1fb1' \\(did you mean '1f1b'"):
        trainer.Trainer(_params('task.pipeline.schedule=1fb1'), str(tmp_path / 's')).Build()
    with pytest.raises(ValueError, match='larger than the number of layers'):
        trainer.Trainer(_params('task.pipeline.num_partitions=100'), str(tmp_path / 'k')).Build()
    with pytest.raises(ValueError, match=r'cluster.logical_cpus\(8\)'):
        trainer.Trainer(_params('task.pipeline.num_partitions=8'), str(tmp_path / 'd')).Build()
