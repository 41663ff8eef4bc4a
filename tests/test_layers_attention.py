"""MultiHeadAttention: hand-written reference, masks (padding, causal, packed), FPropMeta."""

import numpy as np
import pytest
import tensorflow as tf

from tests import layer_testing
from tf_gpipe import layers


def _p(**kw):
    return (
        layers.MultiHeadAttention.Params()
        .Set(name='att', input_dim=8, num_heads=2, random_seed=4)
        .Set(**kw)
    )


def reference_attention(v, q_in, s_in, num_heads, mask=None):
    """Written out: projections, per-head softmax(QK^T/sqrt(d)) V, output projection."""
    q = tf.matmul(q_in, v.w_query) + v.b_query
    k = tf.matmul(s_in, v.w_key) + v.b_key
    val = tf.matmul(s_in, v.w_value) + v.b_value
    outs = []
    d = q.shape[-1] // num_heads
    for h in range(num_heads):
        sl = slice(h * d, (h + 1) * d)
        logits = tf.matmul(q[..., sl], k[..., sl], transpose_b=True) / np.sqrt(d)
        if mask is not None:
            logits += (1.0 - mask) * -1e9
        outs.append(tf.matmul(tf.nn.softmax(logits), val[..., sl]))
    return tf.matmul(tf.concat(outs, -1), v.w_post) + v.b_post


@pytest.mark.parametrize('cross', [False, True])
def test_gradients_match_reference(cross):
    layer = _p().Instantiate()
    x = tf.random.stateless_normal([2, 5, 8], [1, 2])
    src = tf.random.stateless_normal([2, 3, 8], [3, 4])
    v = layer.vars
    if cross:
        run = lambda x: layer.FProp(x, src)  # noqa: E731
        ref = lambda x: reference_attention(v, x, src, 2)  # noqa: E731
    else:
        run, ref = layer.FProp, lambda x: reference_attention(v, x, x, 2)
    layer_testing.assert_same_grads(run, ref, x, layer.trainable_variables, rtol=1e-4, atol=1e-5)
    layer_testing.check_meta(_p(), x)


def test_masks_match_reference():
    layer = _p(causal=True).Instantiate()
    x = tf.random.stateless_normal([2, 4, 8], [5, 6])
    paddings = tf.constant([[0, 0, 0, 1], [0, 0, 0, 0]], tf.float32)
    segments = tf.constant([[1, 1, 1, 1], [1, 1, 2, 2]])
    causal = np.tril(np.ones([4, 4], np.float32))
    mask = causal[None] * (1 - paddings[:, None, :].numpy())
    mask *= segments[:, :, None].numpy() == segments[:, None, :].numpy()
    y = layer.FProp(x, None, paddings, segments)
    ref = reference_attention(layer.vars, x, x, 2, tf.constant(mask))
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


def test_causal_and_padding_hide_what_they_should():
    layer = _p(causal=True).Instantiate()
    x = tf.random.stateless_normal([1, 6, 8], [7, 8])
    changed = tf.concat([x[:, :3], x[:, 3:] * 5.0], axis=1)  # change the future
    np.testing.assert_allclose(layer.FProp(x)[:, :3], layer.FProp(changed)[:, :3], rtol=1e-5)
    plain = _p().Instantiate()
    pads = tf.constant([[0, 0, 0, 1, 1, 1]], tf.float32)
    keep = plain.FProp(x, None, pads)[:, :3]
    other = plain.FProp(tf.concat([x[:, :3], changed[:, 3:]], 1), None, pads)[:, :3]
    np.testing.assert_allclose(keep, other, rtol=1e-5, atol=1e-6)


def test_heads_must_divide():
    with pytest.raises(ValueError, match='not divisible by num_heads 3'):
        _p(num_heads=3).Instantiate()


def test_batch_and_length_known_only_at_run_time():
    # A served model has a variable batch: the head size must stay static (it was -1, and
    # math.sqrt(None) failed).
    layer = _p().Instantiate()
    x = tf.random.stateless_normal([3, 5, 8], [1, 2])
    fn = tf.function(layer.FProp).get_concrete_function(tf.TensorSpec([None, None, 8]))
    assert fn.output_shapes.as_list() == [None, None, 8]
    np.testing.assert_allclose(fn(x), layer.FProp(x), rtol=1e-6, atol=1e-6)
