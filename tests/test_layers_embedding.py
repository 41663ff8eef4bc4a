"""EmbeddingLayer: lookup, scaling, gradients, FPropMeta, errors."""

import math

import pytest
import tensorflow as tf

from tests import layer_testing
from tf_gpipe import layers


def _p(**kw):
    return layers.EmbeddingLayer.Params().Set(name='emb', vocab_size=11, embedding_dim=4).Set(**kw)


@pytest.mark.parametrize('scale', [False, True])
def test_lookup_and_gradients(scale):
    layer = _p(scale_sqrt_depth=scale).Instantiate()
    ids = tf.constant([[1, 2, 10], [0, 1, 1]])
    emb = layer.vars.emb
    factor = math.sqrt(4) if scale else 1.0

    def run(fn):
        with tf.GradientTape() as tape:
            y = fn()
            loss = tf.reduce_sum(y * tf.random.stateless_normal(y.shape, [1, 1]))
        return y, tf.convert_to_tensor(tape.gradient(loss, emb))

    y1, g1 = run(lambda: layer.FProp(ids))
    y2, g2 = run(lambda: tf.matmul(tf.one_hot(ids, 11), emb) * factor)
    assert y1.shape == [2, 3, 4]
    tf.debugging.assert_near(y1, y2, rtol=1e-6)
    tf.debugging.assert_near(g1, g2, rtol=1e-6)
    meta = layer_testing.check_meta(_p(scale_sqrt_depth=scale), ids)
    assert meta.param_count == 44


def test_bad_vocab():
    with pytest.raises(ValueError, match='vocab_size must be a positive int'):
        _p(vocab_size=0).Instantiate()
