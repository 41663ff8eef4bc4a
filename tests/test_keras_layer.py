"""KerasLayer: wraps Keras layers, tracks their variables, seeds them, FPropMeta."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import layer_testing
from tf_gpipe import fprop_context, layers


def _dense(**kw):
    return (
        layers.KerasLayer.Params()
        .Set(
            name='dense',
            keras_layer='Dense',
            config={'units': 3, 'activation': 'tanh'},
            input_shape=(None, 5),
        )
        .Set(**kw)
    )


def test_dense_gradients_and_variables():
    layer = _dense().Instantiate()
    assert len(layer.trainable_variables) == 2
    w, b = layer.keras_layer.kernel.value, layer.keras_layer.bias.value
    x = tf.random.stateless_normal([4, 5], [1, 6])
    layer_testing.assert_same_grads(
        layer.FProp, lambda x: tf.tanh(tf.matmul(x, w) + b), x, layer.trainable_variables
    )
    meta = layer_testing.check_meta(_dense(), x)
    assert meta.param_count == 18 and meta.flops >= 2 * 15 * 4


def test_class_and_lazy_build():
    p = layers.KerasLayer.Params().Set(
        name='conv', keras_layer=keras.layers.Conv2D, config={'filters': 2, 'kernel_size': 3}
    )
    layer = p.Instantiate()
    assert layer.trainable_variables == ()
    y = layer.FProp(tf.ones([1, 5, 5, 1]))
    assert y.shape == [1, 3, 3, 2] and len(layer.trainable_variables) == 2
    layer_testing.check_meta(p, tf.ones([1, 5, 5, 1]))


def test_seeded_weights_are_reproducible():
    a = _dense(random_seed=3).Instantiate()
    b = _dense(random_seed=3).Instantiate()
    c = _dense(random_seed=4).Instantiate()
    np.testing.assert_array_equal(a.vars.kernel, b.vars.kernel)
    assert not np.allclose(a.vars.kernel, c.vars.kernel)


def test_training_flag_reaches_keras():
    p = layers.KerasLayer.Params().Set(
        name='bn', keras_layer='BatchNormalization', input_shape=(None, 2)
    )
    layer = p.Instantiate()
    x = tf.constant([[1.0, 2.0], [3.0, 6.0]])
    train = layer.FProp(x).numpy()
    with fprop_context.eval_mode():
        infer = layer.FProp(x).numpy()
    assert abs(train.mean()) < 1e-3 and not np.allclose(train, infer)


def test_bad_keras_layer():
    with pytest.raises(ValueError, match='keras.layers.Layer subclass'):
        layers.KerasLayer.Params().Set(name='k', keras_layer='Dens').Instantiate()
