"""PoolingLayer and GlobalPoolingLayer: values, gradients, FPropMeta."""

import numpy as np
import pytest
import tensorflow as tf

from tests import layer_testing
from tf_gpipe import layers


@pytest.mark.parametrize('ptype,padding', [('MAX', 'SAME'), ('AVG', 'VALID'), ('AVG', 'SAME')])
def test_pooling(ptype, padding):
    p = layers.PoolingLayer.Params().Set(
        name='pool', pooling_type=ptype, padding=padding, window_shape=(3, 3), window_stride=(2, 2)
    )
    layer = p.Instantiate()
    x = tf.random.stateless_normal([2, 7, 7, 3], [1, 1])
    ref_fn = tf.nn.max_pool2d if ptype == 'MAX' else tf.nn.avg_pool2d
    layer_testing.assert_same_grads(layer.FProp, lambda x: ref_fn(x, 3, 2, padding), x, [])
    layer_testing.check_meta(p, x)


@pytest.mark.parametrize('ptype', ['MAX', 'AVG'])
def test_global_pooling(ptype):
    p = layers.GlobalPoolingLayer.Params().Set(name='gp', pooling_type=ptype)
    x = tf.random.stateless_normal([2, 4, 5, 3], [2, 2])
    y = p.Instantiate().FProp(x)
    ref = x.numpy().max(axis=(1, 2)) if ptype == 'MAX' else x.numpy().mean(axis=(1, 2))
    np.testing.assert_allclose(y, ref, rtol=1e-6)
    reduce = tf.reduce_max if ptype == 'MAX' else tf.reduce_mean
    layer_testing.assert_same_grads(p.Instantiate().FProp, lambda x: reduce(x, [1, 2]), x, [])
    layer_testing.check_meta(p, x)


def test_bad_type():
    with pytest.raises(ValueError, match='pooling_type must be one of'):
        layers.PoolingLayer.Params().Set(name='p', pooling_type='MIN').Instantiate()
