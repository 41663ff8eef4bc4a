"""FCLayer: shapes, gradients against a hand-written matmul, FPropMeta, errors, bfloat16."""

import pytest
import tensorflow as tf

from tests import layer_testing
from tf_gpipe import layers


def _p(**kw):
    return layers.FCLayer.Params().Set(name='fc', input_dim=5, output_dim=3).Set(**kw)


@pytest.mark.parametrize(
    'activation,fn',
    [
        ('RELU', tf.nn.relu),
        ('TANH', tf.tanh),
        ('SIGMOID', tf.sigmoid),
        ('NONE', tf.identity),
        ('SWISH', tf.nn.silu),
        ('GELU', lambda x: tf.nn.gelu(x, approximate=False)),
    ],
)
def test_gradients_match_hand_written(activation, fn):
    layer = _p(activation=activation).Instantiate()
    x = tf.random.stateless_normal([4, 2, 5], [0, 1])
    w, b = layer.vars.w, layer.vars.b
    layer_testing.assert_same_grads(
        layer.FProp, lambda x: fn(tf.einsum('bti,io->bto', x, w) + b), x, [w, b]
    )


def test_shape_and_meta():
    x = tf.ones([6, 5])
    assert _p().Instantiate().FProp(x).shape == [6, 3]
    meta = layer_testing.check_meta(_p(), x)
    assert meta.flops == 6 * 3 * (2 * 5 + 1 + 1)
    assert meta.activation_bytes == 6 * 3 * 4
    assert layer_testing.check_meta(_p(bias=False), tf.ones([2, 7, 5])).param_count == 15


def test_errors():
    with pytest.raises(ValueError, match="did you mean 'RELU'"):
        _p(activation='RELLU').Instantiate()
    with pytest.raises(ValueError, match='input_dim must be a positive int'):
        _p(input_dim=0).Instantiate()
    with pytest.raises(ValueError, match='last dimension is 4, but input_dim is 5'):
        _p().Instantiate().FProp(tf.ones([2, 4]))


def test_bfloat16_fprop():
    layer = _p(fprop_dtype=tf.bfloat16).Instantiate()
    y = layer.FProp(tf.ones([2, 5]))
    assert y.dtype == tf.bfloat16 and layer.vars.w.dtype == tf.float32
    ref = _p().Instantiate()
    ref.vars.w.assign(layer.vars.w)
    assert abs(float(tf.reduce_sum(tf.cast(y, tf.float32) - ref.FProp(tf.ones([2, 5]))))) < 0.1
