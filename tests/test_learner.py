"""Learner: optimizers, schedules, clipping, L2."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.placement_testing import bulk_unplaced, misplaced_updates
from tf_gpipe.runtime import placement
from tf_gpipe.trainer import fused_adam
from tf_gpipe.trainer.learner import Learner


def _learner(**kw):
    return Learner.Params().Set(**kw).Instantiate()


def test_schedules():
    const = _learner(learning_rate=0.1, schedule='constant', warmup_steps=10)
    assert float(const.schedule(0)) == pytest.approx(0.01)
    assert float(const.schedule(100)) == pytest.approx(0.1)
    rsqrt = _learner(learning_rate=1.0, schedule='warmup_rsqrt', warmup_steps=100)
    assert float(rsqrt.schedule(49)) == pytest.approx(0.5)
    assert float(rsqrt.schedule(99)) == pytest.approx(1.0)
    assert float(rsqrt.schedule(399)) == pytest.approx(0.5)
    cosine = _learner(learning_rate=1.0, schedule='cosine', total_steps=100)
    assert float(cosine.schedule(49)) == pytest.approx(0.5, abs=1e-6)
    assert float(cosine.schedule(1000)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize('optimizer', ['sgd', 'momentum', 'adam', 'rmsprop'])
def test_optimizers_descend(optimizer):
    learner = _learner(optimizer=optimizer, learning_rate=0.05)
    v = tf.Variable([3.0, -2.0])
    learner.Build([v])
    for _ in range(20):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(v))
        learner.Apply(tape.gradient(loss, [v]), [v])
    assert float(tf.reduce_sum(tf.square(v))) < 13.0 * 0.8


def test_clipping_and_l2():
    learner = _learner(optimizer='sgd', learning_rate=1.0, clip_gradient_norm=1.0)
    v = tf.Variable([0.0, 0.0])
    stats = learner.Apply([tf.constant([3.0, 4.0])], [v])
    assert float(stats.grad_norm) == pytest.approx(5.0)
    np.testing.assert_allclose(v.numpy(), [-0.6, -0.8], rtol=1e-6)
    l2 = _learner(optimizer='sgd', learning_rate=1.0, l2_regularizer_weight=0.5)
    w, u = tf.Variable([2.0]), tf.Variable([2.0])
    l2.Apply([tf.constant([0.0]), tf.constant([0.0])], [w, u], regularized=[w])
    assert float(w[0]) == pytest.approx(1.0) and float(u[0]) == pytest.approx(2.0)


@pytest.mark.parametrize('optimizer', ['momentum', 'adam'])
def test_gradient_work_and_updates_run_on_the_variables_devices(optimizer):
    learner = _learner(optimizer=optimizer, clip_gradient_norm=1.0, l2_regularizer_weight=0.1)
    variables, grads = [], []
    for i in (1, 3):
        with tf.device(f'/device:CPU:{i}'):
            variables.append(tf.Variable(tf.ones([4, 3]) * i))
            grads.append(tf.ones([4, 3]) * 2.0)
    learner.Build(variables)
    step = tf.function(lambda: learner.Apply(grads, variables, regularized=variables[:1]))
    graph = step.get_concrete_function().graph
    assert misplaced_updates(graph) == []
    assert bulk_unplaced(graph) == []  # only the norm's scalars meet off the devices
    fused = [op for op in graph.get_operations() if op.type == 'ResourceApplyAdam']
    assert len(fused) == (2 if optimizer == 'adam' else 0)  # one op per variable


def _adam_pair(devices=('/device:CPU:1', '/device:CPU:3')):
    """Two copies of the same variables (a matrix, a vector, a scalar) on `devices`."""
    init = [np.arange(12.0).reshape(4, 3) / 7 - 0.5, np.array([0.3, -1.2, 2.0]), np.array(0.7)]
    copies = []
    for _ in range(2):
        variables = []
        for i, value in enumerate(init):
            with tf.device(devices[i % len(devices)]):
                variables.append(tf.Variable(value.astype('float32')))
        copies.append(variables)
    return copies


@pytest.mark.parametrize('traced', [False, True])
def test_fused_adam_equals_keras_adam(traced):
    """The learner's Adam (the fused kernel on Keras's slots) takes Keras Adam.update_step's
    steps: weights, both slots and the step count within 1e-6 over 6 steps of a warm-up
    schedule, eagerly and in a tf.function; the slots keep Keras's names (the checkpoint's)."""
    learner = _learner(optimizer='adam', learning_rate=0.05, schedule='warmup_rsqrt',
                       warmup_steps=3, beta1=0.8, beta2=0.95, epsilon=1e-6)  # fmt: skip
    mine, theirs = _adam_pair()
    learner.Build(mine)
    assert fused_adam.applies(learner.optimizer)
    keras_adam = keras.optimizers.Adam(learner.schedule, beta_1=0.8, beta_2=0.95, epsilon=1e-6)
    placement.build_optimizer(keras_adam, theirs)

    def steps(i):
        grads = [tf.sin(tf.cast(i + 1, tf.float32) * (v + 1.0)) for v in mine]
        learner.Update(grads, mine)
        keras_adam.apply_gradients(zip(grads, theirs))

    step = tf.function(steps) if traced else steps
    for i in range(6):
        step(tf.constant(i))
    if traced:
        ops = [op.type for op in step.get_concrete_function(tf.constant(0)).graph.get_operations()]
        assert ops.count('ResourceApplyAdam') == 3, sorted(set(ops))
    assert int(learner.optimizer.iterations.numpy()) == int(keras_adam.iterations.numpy()) == 6
    for a, b in zip(mine, theirs):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    ours = sorted(v.name for v in learner.optimizer.variables)
    assert ours == sorted(v.name for v in keras_adam.variables)
    assert any(name.endswith('_momentum') for name in ours), ours
    for a, b in zip(learner.optimizer.variables, keras_adam.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert float(np.abs(mine[0].numpy() - _adam_pair()[0][0].numpy()).max()) > 0.01  # it moved


def test_adam_the_kernel_cannot_compute_runs_as_keras():
    """An Adam with AMSGrad, weight decay, EMA or clipping of its own is not a fused one."""
    assert fused_adam.applies(keras.optimizers.Adam())
    for kw in (dict(amsgrad=True), dict(weight_decay=0.1), dict(use_ema=True),
               dict(clipnorm=1.0), dict(global_clipnorm=1.0)):  # fmt: skip
        assert not fused_adam.applies(keras.optimizers.Adam(**kw)), kw
    assert not fused_adam.applies(keras.optimizers.AdamW())


def test_bad_names():
    with pytest.raises(ValueError, match='learner.optimizer must be one of'):
        _learner(optimizer='adamw')
    with pytest.raises(ValueError, match='learner.schedule must be one of'):
        _learner(schedule='linear')
