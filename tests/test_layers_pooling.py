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


@pytest.mark.parametrize('padding', ['SAME', 'VALID'])
def test_max_pool_gradient_with_ties_in_tf_function_and_half_precision(padding):
    """The recomputing gradient is TF's own, ties (a window's equal maxima) included."""
    layer = layers.PoolingLayer.Params().Set(name='pool', padding=padding).Instantiate()
    x = tf.round(tf.random.stateless_normal([2, 6, 6, 3], [3, 3]))  # many ties
    ref = lambda x: tf.nn.max_pool2d(x, 2, 2, padding)  # noqa: E731
    layer_testing.assert_same_grads(tf.function(layer.FProp), ref, x, [])
    half = layers.PoolingLayer.Params().Set(name='half', fprop_dtype=tf.float16).Instantiate()
    layer_testing.assert_same_grads(
        lambda x: tf.cast(half.FProp(x), tf.float32),
        lambda x: tf.cast(ref(tf.cast(x, tf.float16)), tf.float32),
        x,
        [],
    )


def test_a_max_pool_backward_traced_apart_from_its_forward_holds_its_own_pool():
    """A kept micro-batch's backward is a function of its own (TF derives it from the
    forward's call). oneDNN's fast MaxPoolGrad needs the workspace of a MaxPool in the same
    graph, so that backward recomputes the pooling; without it, Eigen's kernel made
    AmoebaNet-D's kept step 1.6x the plain one's (docs/results.md)."""
    layer = layers.PoolingLayer.Params().Set(name='pool', window_shape=(3, 3)).Instantiate()
    x = tf.random.stateless_normal([2, 8, 8, 3], [4, 4])
    ops = layer_testing.derived_backward_ops(tf.function(layer.FProp), x, tf.ones([2, 4, 4, 3]))
    assert ops.count('MaxPoolGrad') == 1 and ops.count('MaxPool') == 1, ops


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
