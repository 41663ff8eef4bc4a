"""SoftmaxLayer: logits, cross-entropy with label smoothing and weights, gradients, meta."""

import numpy as np
import pytest
import tensorflow as tf

from tests import layer_testing
from tf_gpipe import layers


def _p(**kw):
    return layers.SoftmaxLayer.Params().Set(name='sm', input_dim=6, num_classes=5).Set(**kw)


@pytest.mark.parametrize('smoothing', [0.0, 0.1])
def test_loss_and_gradients_match_keras_style_reference(smoothing):
    layer = _p(label_smoothing=smoothing).Instantiate()
    x = tf.random.stateless_normal([4, 6], [1, 4])
    labels = tf.constant([0, 4, 2, 2])
    weights = tf.constant([1.0, 0.5, 0.0, 2.0])
    w, b = layer.vars.w, layer.vars.b

    def ours(x):
        return layer.XentLoss(layer.FProp(x), labels, weights).avg_xent

    def ref(x):
        logits = tf.matmul(x, w) + b
        targets = tf.one_hot(labels, 5) * (1 - smoothing) + smoothing / 5
        xent = tf.nn.softmax_cross_entropy_with_logits(targets, logits)
        return tf.reduce_sum(xent * weights) / tf.reduce_sum(weights)

    layer_testing.assert_same_grads(ours, ref, x, [w, b])
    out = layer.XentLoss(layer.FProp(x), labels)
    assert out.per_example_xent.shape == [4] and float(out.total_weight) == 4.0
    np.testing.assert_allclose(out.avg_xent, tf.reduce_mean(out.per_example_xent), rtol=1e-6)
    meta = layer_testing.check_meta(_p(), tf.ones([3, 7, 6]))
    assert meta.out_shapes[0] == [3, 7, 5]


def test_bad_smoothing():
    with pytest.raises(ValueError, match='label_smoothing'):
        _p(label_smoothing=1.0).Instantiate()
