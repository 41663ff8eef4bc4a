"""Checkpoints keyed by layer path: names independent of K and replicas, a checkpoint written at
K=2 resumes at K=4 exactly, other models and optimizers refused in one line, inspection, warm
start by name-mapping rules, and optimizer slots filed under their variables."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe import hyperparams, model_registry
from tf_gpipe.runtime import cluster
from tf_gpipe.trainer import checkpoints, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = 'lm.synthetic.TransformerLmTiny'
model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))


def _params(overrides, key=MODEL):
    model = model_registry.GetClass(key)()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    hyperparams.apply_overrides(p, f'task.pipeline.num_micro_batches=2; {overrides}')
    return p


def _weights(t):
    return {k: v.numpy() for k, v in t.named_checkpoint.named.items()}


@pytest.fixture(scope='module')
def k2_run(tmp_path_factory):
    """A K=2 run saved at step 2, and the same trainer continued to step 3."""
    logdir = str(tmp_path_factory.mktemp('k2'))
    p = _params('task.pipeline.num_partitions=2; task.train.max_steps=2')
    t = trainer.Trainer(p, logdir)
    t.Train()
    at_2 = _weights(t)
    ckpt = t.manager.latest_checkpoint
    t.params = t.params.Copy()  # the frozen params of a built trainer: only the loop reads this
    t.params.task.train.max_steps = 3
    t.Train()
    return logdir, ckpt, at_2, _weights(t)


def test_names_are_layer_paths_without_cells(k2_run):
    _, ckpt, at_2, _ = k2_run
    names = {name for name, _ in tf.train.list_variables(ckpt)}
    for expected in (
        'task/network/emb/emb/.ATTRIBUTES/VARIABLE_VALUE',
        'task/network/layer00/atten/w_query/.ATTRIBUTES/VARIABLE_VALUE',
        'optimizer/task/network/layer00/atten/w_query/momentum/.ATTRIBUTES/VARIABLE_VALUE',
        'optimizer/task/network/layer00/atten/w_query/velocity/.ATTRIBUTES/VARIABLE_VALUE',
        'optimizer/iterations/.ATTRIBUTES/VARIABLE_VALUE',
        'global_step/.ATTRIBUTES/VARIABLE_VALUE',
    ):
        assert expected in names
    assert not [n for n in names if 'cell' in n or '_trainable_variables' in n]
    assert sorted(at_2) == sorted(k for k in at_2 if k.startswith('task/network/'))


def test_k2_checkpoint_resumes_at_k4_exactly(k2_run, tmp_path):
    logdir, ckpt, at_2, at_3 = k2_run
    t = trainer.Trainer(_params('task.pipeline.num_partitions=4; task.train.max_steps=3'), logdir)
    t.Build()
    assert t.named_checkpoint.Restore(ckpt) is None and int(t.global_step) == 2
    assert sorted(_weights(t)) == sorted(at_2)
    for name, value in _weights(t).items():
        np.testing.assert_array_equal(value, at_2[name], err_msg=name)
    t.Train()  # step 3 at K=4 equals step 3 at K=2
    for name, value in _weights(t).items():
        np.testing.assert_allclose(value, at_3[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_replicas_restore_from_one_replica(k2_run, tmp_path):
    _, ckpt, at_2, _ = k2_run
    p = _params('task.pipeline.num_partitions=2; task.pipeline.num_replicas=2')
    t = trainer.Trainer(p, str(tmp_path))
    t.Build()
    t.named_checkpoint.Restore(ckpt)
    copy = t.task.NamedVariables(replica=1)
    assert len(copy) == len(at_2)
    for name, var in copy.items():
        np.testing.assert_array_equal(var.numpy(), at_2[f'task/{name}'], err_msg=name)


def test_other_optimizer_or_model_refused_in_one_line(k2_run):
    logdir, *_ = k2_run
    t = trainer.Trainer(_params('task.train.learner.optimizer=sgd'), logdir)
    with pytest.raises(RuntimeError, match="written with optimizer 'adam', this model uses 'sgd'"):
        t.Restore()
    t = trainer.Trainer(_params('task.model_dim=32'), logdir)
    with pytest.raises(RuntimeError, match=r'task/network/emb/emb has shape \(64, 64\)') as e:
        t.Restore()
    assert '\n' not in str(e.value)


def test_inspect_checkpoint(k2_run, tmp_path):
    logdir, ckpt, *_ = k2_run
    text = checkpoints.InspectText(logdir)  # a logdir: its latest checkpoint
    assert text.splitlines()[0].endswith('step 3, optimizer adam, 212 variables')
    assert 'task/network/layer01/ffn_out/w' in text and 'cell' not in text
    step, optimizer, rows = checkpoints.Inspect(ckpt)
    assert (step, optimizer) == (2, 'adam')
    assert ('task/network/emb/emb', (64, 64), 'float32') in rows
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, 'tools', 'trainer.py'),
            '--mode=inspect_checkpoint',
            f'--checkpoint={ckpt}',
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 'optimizer/task/network/emb/emb/velocity' in proc.stdout
    with pytest.raises(FileNotFoundError, match='is not a checkpoint'):
        checkpoints.InspectText(f'{ckpt}x')
    # A garbage file where the index should be: one line (the tool exits 1 with it), no
    # traceback.
    garbage = str(tmp_path / 'garbage')
    with open(f'{garbage}.index', 'w') as f:
        f.write('not a checkpoint\n')
    with pytest.raises(ValueError, match=f'{garbage} is not a readable checkpoint'):
        checkpoints.InspectText(garbage)


def test_warm_start_by_rules(k2_run, tmp_path):
    _, ckpt, at_2, _ = k2_run
    rules = {ckpt: ([('task/network/(layer.*)', 'task/network/%s')], ['.*/ln_.*'])}
    p = _params('task.pipeline.num_partitions=1')
    p.task.train.init_from_checkpoint_rules = rules
    t = trainer.Trainer(p, str(tmp_path / 'warm'))
    assert t.Restore() is None and int(t.global_step) == 0
    for name, value in _weights(t).items():
        if value.dtype != np.float32:
            continue
        loaded = name.startswith('task/network/layer') and '/ln_' not in name
        assert np.array_equal(value, at_2[name]) == loaded, name
    assert int(t.learner.optimizer.iterations) == 0  # weights only, no optimizer state
    bad = {ckpt: ([('task/network/(emb)/emb', 'task/network/%s/embedding')], [])}
    p.task.train.init_from_checkpoint_rules = bad
    with pytest.raises(ValueError, match="maps to 'task/network/emb/embedding'.*closest"):
        trainer.Trainer(p, str(tmp_path / 'bad')).Restore()
    p.task.train.init_from_checkpoint_rules = {ckpt: 'task/network'}
    with pytest.raises(ValueError, match='init_from_checkpoint_rules=.* must be'):
        trainer.Trainer(p, str(tmp_path / 'malformed')).Build()


@pytest.mark.parametrize(
    'make',
    [
        lambda: keras.optimizers.Adam(0.1),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.RMSprop(0.1, momentum=0.9, centered=True),
    ],
)
def test_optimizer_slots_belong_to_their_variables(make):
    """Two variables of one name (replica copies) and one whose name extends the other's: after
    a step with a gradient on one variable only, only its slots moved."""
    a = tf.Variable(tf.ones([2, 3]), name='fc/w')
    b = tf.Variable(tf.ones([2, 3]), name='fc/w')
    c = tf.Variable(tf.ones([3]), name='fc/w_0_x')
    optimizer = make()
    optimizer.build([a, b, c])
    slots, others = checkpoints.optimizer_slots(optimizer, [a, b, c])
    assert [sorted(s) for s in slots] == [sorted(slots[0])] * 3 and slots[0]
    assert {o.name for o in others} <= {'iteration', 'learning_rate'}
    for moved in range(3):
        for s in slots:
            for ov in s.values():
                ov.assign(tf.zeros_like(ov))
        grads = [
            tf.ones_like(v) if i == moved else tf.zeros_like(v) for i, v in enumerate([a, b, c])
        ]
        optimizer.apply_gradients(zip(grads, [a, b, c]))
        for i, s in enumerate(slots):
            for name, ov in s.items():
                assert bool(np.any(ov.numpy() != 0)) == (i == moved), (i, name)


def test_strategy_replicas_resume_and_train_as_one_pipeline(k2_run, tmp_path):
    """R=2 x K=2 under mesh.strategy() with M=1 (R*M = the K=2 run's M=2), restored from that
    run's step-2 checkpoint: its step 3 (dropout included) equals the K=2 run's step 3."""
    logdir, ckpt, at_2, at_3 = k2_run
    mesh = cluster.DeviceMesh.from_local(num_replicas=2, num_stages=2)
    p = _params('task.pipeline.num_partitions=2; task.pipeline.num_micro_batches=1')
    p.task.train.max_steps = 3
    t = trainer.Trainer(p, str(tmp_path))
    with mesh.strategy().scope():
        t.Build()
    assert t.strategy is mesh.strategy()
    t.named_checkpoint.Restore(ckpt)
    assert int(t.global_step.numpy()) == 2
    for name, value in _weights(t).items():
        np.testing.assert_array_equal(value, at_2[name], err_msg=name)
    t.Train()
    for name, value in _weights(t).items():
        if name.endswith('b_key'):
            # Softmax ignores a bias added to every key: its exact gradient is zero, and both
            # runs' values are Adam's response to rounding noise (summed in another order over
            # the replicas), so they are only small (seen: -1.3e-6 against -2.4e-6).
            assert np.abs(value).max() < 1e-4 and np.abs(at_3[name]).max() < 1e-4, name
            continue
        np.testing.assert_allclose(value, at_3[name], rtol=1e-5, atol=1e-6, err_msg=name)
