"""Learner: optimizers, schedules, clipping, L2."""

import numpy as np
import pytest
import tensorflow as tf

from tests.placement_testing import bulk_unplaced, misplaced_updates
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


def test_bad_names():
    with pytest.raises(ValueError, match='learner.optimizer must be one of'):
        _learner(optimizer='adamw')
    with pytest.raises(ValueError, match='learner.schedule must be one of'):
        _learner(schedule='linear')
