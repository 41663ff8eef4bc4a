"""keras_state: replayable Keras randomness and once-per-step Keras batch norm."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import layer_testing
from tf_gpipe import fprop_context, layers
from tf_gpipe.keras import state as keras_state


def _wrapped(keras_layer, config, shape):
    return (
        layers.KerasLayer.Params()
        .Set(name='k', keras_layer=keras_layer, config=config, input_shape=shape)
        .Instantiate()
    )


def test_random_draws_depend_only_on_step_and_micro_batch():
    layer = _wrapped('Dropout', {'rate': 0.5, 'seed': 3}, (None, 64))
    x = tf.ones([4, 64])

    def draw(step, micro_batch):
        with fprop_context.scope(step=step, seed_offset=micro_batch):
            return layer.FProp(x).numpy()

    first = draw(0, 0)
    np.testing.assert_array_equal(draw(0, 0), first)  # a recompute replays the mask
    assert not np.array_equal(draw(0, 1), first)
    assert not np.array_equal(draw(1, 0), first)
    # Outside a pipeline (no step) Keras' own generator advances: a new mask every call.
    assert not np.array_equal(layer.FProp(x).numpy(), layer.FProp(x).numpy())


def test_seed_generators_of_nested_layers_are_found():
    class Block(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.drop = keras.layers.Dropout(0.5)
            self.noise = keras.layers.GaussianNoise(1.0)

        def call(self, x, training=None):
            return self.noise(self.drop(x, training=training), training=training)

    assert len(keras_state.seed_generators(Block())) == 2


class _NormBlock(keras.layers.Layer):
    """A custom layer with a BatchNormalization inside."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.bn = keras.layers.BatchNormalization(momentum=0.8)

    def build(self, shape):
        self.bn.build(shape)

    def call(self, x, training=None):
        return self.bn(x, training=training) * 2.0


def test_batch_norm_accumulates_and_moves_once_per_step():
    layer = _wrapped(_NormBlock, {}, (None, 3))
    bn = layer.keras_layer.bn
    x = tf.random.stateless_normal([8, 3], [1, 2]) * 3.0 + 1.0
    parts = tf.split(x, 2)
    with fprop_context.scope(step=0, seed_offset=0):
        y0 = layer.FProp(parts[0])
    with fprop_context.scope(step=0, seed_offset=1):
        layer.FProp(parts[1])
    with fprop_context.scope(step=0, seed_offset=1, recompute=True):
        layer.FProp(parts[1])  # a recompute adds nothing
    mean, var = tf.nn.moments(parts[0], [0])
    np.testing.assert_allclose(y0, 2.0 * (parts[0] - mean) / np.sqrt(var + 1e-3), atol=1e-5)
    np.testing.assert_array_equal(bn.moving_mean, np.zeros(3))  # not moved per call
    layer.PostTrainingStepUpdate()
    full_mean, full_var = tf.nn.moments(x, [0])
    np.testing.assert_allclose(bn.moving_mean, 0.2 * full_mean, rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance, 0.8 + 0.2 * full_var, rtol=1e-5)
    layer.PostTrainingStepUpdate()  # nothing seen since: no move
    np.testing.assert_allclose(bn.moving_mean, 0.2 * full_mean, rtol=1e-5)
    with fprop_context.eval_mode():
        y = layer.FProp(x)
    want = 2.0 * (x - bn.moving_mean) / np.sqrt(bn.moving_variance + 1e-3)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_batch_norm_renorm_is_refused():
    with pytest.raises(ValueError, match='renorm=False'):
        _wrapped('BatchNormalization', {'renorm': True}, (None, 3))


def test_a_keras_max_pool_recomputes_its_pooling_in_its_gradient():
    """A wrapped MaxPooling2D gives Keras' values and TF's gradient (ties included), and a
    backward traced apart from its forward (a kept micro-batch's) holds its own pooling, which
    oneDNN's fast MaxPoolGrad on CPU needs (layers/pooling.py). channels_first stays Keras'."""
    config = {'pool_size': 3, 'strides': 2, 'padding': 'same'}
    layer = _wrapped('MaxPooling2D', config, (None, 7, 7, 3))
    plain = keras.layers.MaxPooling2D(**config)
    x = tf.round(tf.random.stateless_normal([2, 7, 7, 3], [5, 5]))  # many ties
    dy = tf.random.stateless_normal([2, 4, 4, 3], [6, 6])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y, want = layer.FProp(x), plain(x)
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(tape.gradient(y, x, dy), tape.gradient(want, x, dy))
    ops = layer_testing.derived_backward_ops(tf.function(layer.FProp), x, dy)
    assert ops.count('MaxPoolGrad') == 1 and ops.count('MaxPool') == 1, ops

    first = keras.layers.MaxPooling2D(2, data_format='channels_first')
    nested = keras.Sequential([first, keras.layers.MaxPooling2D(2)])
    assert keras_state.recomputing_max_pools(nested) == [nested.layers[1]]
