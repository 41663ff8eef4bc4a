"""TransformerLayer: hand-written pre-LN reference, NestedMap pass-through, dropout, FPropMeta."""

import numpy as np
import pytest
import tensorflow as tf

from tests import layer_testing
from tests.test_layers_attention import reference_attention
from tf_gpipe import fprop_context, layers
from tf_gpipe.nested_map import NestedMap


def _p(**kw):
    return (
        layers.TransformerLayer.Params()
        .Set(name='tr', input_dim=8, num_heads=2, hidden_dim=16, random_seed=2)
        .Set(**kw)
    )


def _ln(v, x):
    mean, var = tf.nn.moments(x, [-1], keepdims=True)
    return (x - mean) / tf.sqrt(var + 1e-6) * v.scale + v.bias


def reference(layer, x, aux=None, mask=None):
    """Pre-LN block written out with the layer's variables."""
    x = x + reference_attention(
        layer.atten.vars, _ln(layer.ln_atten.vars, x), _ln(layer.ln_atten.vars, x), 2, mask
    )
    if aux is not None:
        x = x + reference_attention(layer.aux_atten.vars, _ln(layer.ln_aux.vars, x), aux, 2)
    h = _ln(layer.ln_ffn.vars, x)
    h = tf.nn.relu(tf.matmul(h, layer.ffn_in.vars.w) + layer.ffn_in.vars.b)
    return x + tf.matmul(h, layer.ffn_out.vars.w) + layer.ffn_out.vars.b


def test_gradients_match_reference():
    layer = _p(causal=True).Instantiate()
    x = tf.random.stateless_normal([2, 5, 8], [1, 3])
    mask = tf.constant(np.tril(np.ones([5, 5], np.float32)))
    layer_testing.assert_same_grads(
        layer.FProp,
        lambda x: reference(layer, x, mask=mask),
        x,
        layer.trainable_variables,
        rtol=1e-4,
        atol=1e-5,
    )
    layer_testing.check_meta(_p(), x)


def test_decoder_with_nested_map_passes_fields_on():
    p = _p(has_aux_atten=True)
    layer = p.Instantiate()
    x = tf.random.stateless_normal([2, 5, 8], [2, 3])
    aux = tf.random.stateless_normal([2, 3, 8], [4, 3])
    state = NestedMap(vecs=x, aux_vecs=aux, paddings=tf.zeros([2, 5]))
    out = layer.FProp(state)
    assert isinstance(out, NestedMap) and sorted(out) == ['aux_vecs', 'paddings', 'vecs']
    assert out.aux_vecs is aux
    mask = tf.constant(np.ones([5, 5], np.float32))
    np.testing.assert_allclose(out.vecs, reference(layer, x, aux, mask), rtol=1e-4, atol=1e-5)

    def run(v):
        return layer.FProp(NestedMap(vecs=v, aux_vecs=aux)).vecs

    layer_testing.assert_same_grads(
        run, lambda v: reference(layer, v, aux), x, layer.trainable_variables, rtol=1e-4, atol=1e-5
    )
    layer_testing.check_meta(p, state)
    with pytest.raises(ValueError, match="needs 'aux_vecs'"):
        layer.FProp(x)


def test_dropout_is_replayable_and_off_in_eval():
    layer = _p(dropout_prob=0.3, atten_dropout_prob=0.2, relu_dropout_prob=0.1).Instantiate()
    x = tf.random.stateless_normal([2, 5, 8], [6, 3])
    with fprop_context.scope(step=7, seed_offset=1):
        a = layer.FProp(x)
    with fprop_context.scope(step=7, seed_offset=1, recompute=True):
        np.testing.assert_array_equal(a, layer.FProp(x))
    with fprop_context.scope(step=8, seed_offset=1):
        assert not np.allclose(a, layer.FProp(x))
    with fprop_context.eval_mode():
        np.testing.assert_allclose(layer.FProp(x), reference(layer, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('name', ['dropout_prob', 'atten_dropout_prob', 'relu_dropout_prob'])
def test_a_drop_probability_out_of_range_is_named_as_set(name):
    # Named as the user set it, not as the keep_prob (-0.5) the layer derives from it.
    with pytest.raises(
        ValueError, match=rf"'tr': {name} must be a probability in \[0, 1\), got 1.5"
    ):
        _p(**{name: 1.5}).Instantiate()


def _steps(layer, inputs, first, max_len):
    """ExtendStep over `inputs` [B, T, ...]: the first `first` positions in one call (a prompt),
    then one position per call; the outputs concatenated along T."""
    outs, state = [], None
    for a, b in [(0, first)] + [(t, t + 1) for t in range(first, 6)]:
        if isinstance(inputs, dict):
            step = NestedMap(vecs=inputs.vecs[:, a:b], paddings=inputs.paddings[:, a:b])
            if state is None:  # later steps do without the source: it is cached
                step.aux_vecs, step.aux_paddings = inputs.aux_vecs, inputs.aux_paddings
        else:
            step = inputs[:, a:b]
        out, state = layer.ExtendStep(step, state, tf.constant(a), max_len)
        outs.append(out['vecs'] if isinstance(out, dict) else out)
    return tf.concat(outs, axis=1)


@pytest.mark.parametrize('first', [1, 3])
def test_decoding_step_by_step_equals_fprop(first):
    """A causal layer's ExtendStep, with its key/value cache, gives FProp's outputs position by
    position (a prompt of `first` positions in the first call); with cross-attention too, the
    source's keys and values cached at the first call."""
    x = tf.random.stateless_normal([2, 6, 8], [1, 5])
    layer = _p(causal=True).Instantiate()
    np.testing.assert_allclose(_steps(layer, x, first, 9), layer.FProp(x), rtol=1e-5, atol=1e-5)
    dec = _p(causal=True, has_aux_atten=True).Instantiate()
    state = NestedMap(
        vecs=x,
        paddings=tf.zeros([2, 6]),
        aux_vecs=tf.random.stateless_normal([2, 4, 8], [2, 5]),
        aux_paddings=tf.constant([[0.0, 0, 0, 1], [0, 0, 0, 0]]),
    )
    np.testing.assert_allclose(
        _steps(dec, state, first, 6), dec.FProp(state)['vecs'], rtol=1e-5, atol=1e-5
    )


def test_a_non_causal_layer_cannot_step():
    layer = _p(causal=False).Instantiate()
    x = tf.zeros([1, 1, 8])
    out, state = layer.ExtendStep(x, None, tf.constant(0), 4)  # an encoder's one pass
    with pytest.raises(NotImplementedError, match='non-causal.*causal=True'):
        layer.ExtendStep(x, state, tf.constant(1), 4)
