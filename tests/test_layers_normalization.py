"""BatchNormLayer and LayerNorm: values, gradients, moving statistics, FPropMeta."""

import numpy as np
import tensorflow as tf

from tests import layer_testing
from tf_gpipe import fprop_context, layers


def _bn(**kw):
    return layers.BatchNormLayer.Params().Set(name='bn', dim=3, decay=0.9, **kw)


def _perturb(layer):
    for v in layer.trainable_variables:
        v.assign(v + tf.random.stateless_normal(v.shape, [7, len(v.name)]) * 0.3)


def test_batch_norm_training_gradients():
    layer = _bn().Instantiate()
    _perturb(layer)
    x = tf.random.stateless_normal([4, 5, 3], [1, 2]) * 2 + 1
    g, b = layer.vars.gamma, layer.vars.beta

    def ref(x):
        mean, var = tf.nn.moments(x, [0, 1])
        return (x - mean) / tf.sqrt(var + 1e-3) * g + b

    layer_testing.assert_same_grads(layer.FProp, ref, x, [g, b])
    layer_testing.check_meta(_bn(), x)


def test_batch_norm_moving_stats_from_the_whole_step():
    layer = _bn().Instantiate()
    x = tf.random.stateless_normal([8, 3], [3, 4]) * 3 + 5
    for half in (x[:4], x[4:]):  # two micro-batches
        layer.FProp(half)
    with fprop_context.scope(recompute=True):
        layer.FProp(x[:4] * 100)  # a recompute adds nothing
    mean, var = layer.StepStatistics()
    ref_mean, ref_var = tf.nn.moments(x, [0])
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-5)
    np.testing.assert_allclose(var, ref_var, rtol=1e-5)
    layer.PostTrainingStepUpdate()
    np.testing.assert_allclose(layer.vars.moving_mean, 0.1 * ref_mean, rtol=1e-5)
    np.testing.assert_allclose(layer.vars.moving_variance, 0.9 + 0.1 * ref_var, rtol=1e-5)
    assert float(layer.vars.acc_count) == 0
    # An update with nothing accumulated changes nothing.
    layer.PostTrainingStepUpdate()
    np.testing.assert_allclose(layer.vars.moving_mean, 0.1 * ref_mean, rtol=1e-5)


def test_batch_norm_eval_uses_moving_stats():
    layer = _bn().Instantiate()
    layer.vars.moving_mean.assign([1.0, 2.0, 3.0])
    layer.vars.moving_variance.assign([4.0, 4.0, 4.0])
    x = tf.constant([[1.0, 2.0, 5.0]])
    with fprop_context.eval_mode():
        y = layer.FProp(x)
    np.testing.assert_allclose(y, [[0.0, 0.0, 2.0 / np.sqrt(4.001)]], rtol=1e-5)
    assert float(layer.vars.acc_count) == 0


def test_layer_norm_gradients():
    p = layers.LayerNorm.Params().Set(name='ln', input_dim=6)
    layer = p.Instantiate()
    _perturb(layer)
    x = tf.random.stateless_normal([3, 4, 6], [5, 6])
    s, b = layer.vars.scale, layer.vars.bias

    def ref(x):
        mean, var = tf.nn.moments(x, [-1], keepdims=True)
        return (x - mean) / tf.sqrt(var + 1e-6) * s + b

    layer_testing.assert_same_grads(layer.FProp, ref, x, [s, b], rtol=1e-4, atol=1e-5)
    layer_testing.check_meta(p, x)
