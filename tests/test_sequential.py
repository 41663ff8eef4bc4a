"""SequentialLayer and RepeatLayer: chaining, tuples, gradients, FPropMeta."""

import numpy as np
import pytest
import tensorflow as tf

from tests import layer_testing
from tf_gpipe import base_layer, layers


def _fc(name, i=4, o=4, act='RELU'):
    return layers.FCLayer.Params().Set(name=name, input_dim=i, output_dim=o, activation=act)


class _Split(base_layer.BaseLayer):
    """Returns two tensors (to test tuple chaining)."""

    def FProp(self, x):
        return x, 2.0 * x

    @classmethod
    def FPropMeta(cls, p, x):
        return base_layer.Meta(1, (base_layer.to_shape(x), base_layer.to_shape(x)), 0, 0)


class _Add(base_layer.BaseLayer):
    def FProp(self, a, b):
        return a + b

    @classmethod
    def FPropMeta(cls, p, a, b):
        return base_layer.Meta(1, base_layer.to_shape(a), 0, 0)


def test_sequential_matches_composition():
    p = layers.SequentialLayer.Params().Set(
        name='seq', sub=[_fc('a', 3, 4), _fc('b', 4, 2, 'TANH')]
    )
    seq = p.Instantiate()
    a, b = seq.sub
    x = tf.random.stateless_normal([5, 3], [1, 5])

    def ref(x):
        h = tf.nn.relu(tf.matmul(x, a.vars.w) + a.vars.b)
        return tf.tanh(tf.matmul(h, b.vars.w) + b.vars.b)

    layer_testing.assert_same_grads(seq.FProp, ref, x, seq.trainable_variables)
    meta = layer_testing.check_meta(p, x)
    assert meta.param_count == 3 * 4 + 4 + 4 * 2 + 2


def test_tuples_are_splatted_into_the_next_layer():
    p = layers.SequentialLayer.Params().Set(
        name='seq', sub=[_Split.Params().Set(name='split'), _Add.Params().Set(name='add')]
    )
    x = tf.ones([2])
    np.testing.assert_allclose(p.Instantiate().FProp(x), [3.0, 3.0])
    layer_testing.check_meta(p, x)


def test_empty_sequence_is_refused():
    with pytest.raises(ValueError, match='has no sub-layers'):
        layers.SequentialLayer.Params().Set(name='s').Instantiate()


def test_repeat_layer():
    p = layers.RepeatLayer.Params().Set(name='rep', body=_fc('blk'), repeat=3, random_seed=1)
    rep = p.Instantiate()
    assert [c.layer_name for c in rep.body] == ['blk_0', 'blk_1', 'blk_2']
    assert not np.allclose(rep.body[0].vars.w, rep.body[1].vars.w)
    x = tf.random.stateless_normal([2, 4], [9, 9])
    seq = layers.SequentialLayer.Params().Set(name='s', sub=[c.params for c in rep.body])
    plain = seq.Instantiate()
    for v1, v2 in zip(plain.trainable_variables, rep.trainable_variables):
        v1.assign(v2)
    np.testing.assert_allclose(rep.FProp(x), plain.FProp(x), rtol=1e-6)
    meta = layer_testing.check_meta(p, x)
    assert meta.param_count == 3 * (16 + 4)
    with pytest.raises(ValueError, match='set body'):
        layers.RepeatLayer.Params().Set(name='r').Instantiate()
