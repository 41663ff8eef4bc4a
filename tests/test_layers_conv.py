"""Conv2DLayer: shapes, gradients against tf.nn.conv2d, FPropMeta, batch norm, errors."""

import pytest
import tensorflow as tf

from tests import layer_testing
from tf_gpipe import layers


def _p(**kw):
    p = layers.Conv2DLayer.Params().Set(name='conv', filter_shape=(3, 3, 2, 4))
    return p.Set(**kw)


@pytest.mark.parametrize('padding,stride', [('SAME', (1, 1)), ('VALID', (2, 2)), ('SAME', (2, 1))])
def test_gradients_match_hand_written(padding, stride):
    layer = _p(padding=padding, filter_stride=stride).Instantiate()
    x = tf.random.stateless_normal([2, 7, 6, 2], [3, 4])
    w, b = layer.vars.w, layer.vars.b

    def ref(x):
        return tf.nn.relu(tf.nn.conv2d(x, w, [1, *stride, 1], padding) + b)

    layer_testing.assert_same_grads(layer.FProp, ref, x, [w, b])
    layer_testing.check_meta(_p(padding=padding, filter_stride=stride), x)


def test_with_batch_norm():
    p = _p(batch_norm=True, bias=False, activation='NONE')
    layer = p.Instantiate()
    x = tf.random.stateless_normal([3, 5, 5, 2], [5, 6])
    y = layer.FProp(x)
    mean, var = tf.nn.moments(y, [0, 1, 2])
    assert float(tf.reduce_max(tf.abs(mean))) < 1e-4
    assert float(tf.reduce_max(tf.abs(var - 1))) < 1e-2
    layer_testing.check_meta(p, x)


def test_errors():
    with pytest.raises(ValueError, match='filter_shape must be 4 positive ints'):
        _p(filter_shape=(3, 3, 2)).Instantiate()
    with pytest.raises(ValueError, match='padding must be one of'):
        _p(padding='same').Instantiate()
    with pytest.raises(ValueError, match='2 channels'):
        _p().Instantiate().FProp(tf.ones([1, 4, 4, 3]))
