"""Multi-head dot-product attention with padding, causal and packed-segment masks."""

import math

import tensorflow as tf

from tf_gpipe import base_layer
from tf_gpipe.layers import dropout
from tf_gpipe.nested_map import NestedMap

_NEG_INF = -1e9


def attention_bias(
    query_len,
    source_len,
    source_paddings=None,
    causal=False,
    query_segment_ids=None,
    source_segment_ids=None,
):
    """Additive logits bias [B or 1, 1, T, S]: 0 where attending is allowed, -1e9 elsewhere.

    source_paddings [B, S] is 1.0 at padded positions. Packed sequences give segment ids
    [B, T] / [B, S]; a query attends only to keys of its own segment.
    """
    allowed = tf.ones([1, 1, query_len, source_len], tf.bool)
    if source_paddings is not None:
        keep = tf.cast(source_paddings, tf.float32) < 0.5
        allowed = tf.logical_and(allowed, keep[:, tf.newaxis, tf.newaxis, :])
    if causal:
        lower = tf.linalg.band_part(tf.ones([query_len, source_len]), -1, 0) > 0.5
        allowed = tf.logical_and(allowed, lower[tf.newaxis, tf.newaxis])
    if query_segment_ids is not None:
        same = tf.equal(query_segment_ids[:, :, tf.newaxis], source_segment_ids[:, tf.newaxis, :])
        allowed = tf.logical_and(allowed, same[:, tf.newaxis])
    return tf.where(allowed, 0.0, _NEG_INF)


class MultiHeadAttention(base_layer.BaseLayer):
    """Projects query/key/value into num_heads heads, attends, projects back to input_dim."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Model dimension of queries, keys and values.')
        p.Define('num_heads', 1, 'Number of heads.')
        p.Define('hidden_dim', 0, 'Total projection size over heads; 0 means input_dim.')
        p.Define('causal', False, 'Self-attention may only look at earlier positions.')
        p.Define('atten_dropout_prob', 0.0, 'Dropout on the attention probabilities.')
        p.Define('bias', True, 'Biases on the projections.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        base_layer.check_positive(p, 'input_dim', 'num_heads')
        base_layer.check_probability(p, 'atten_dropout_prob')
        hidden = p.hidden_dim or p.input_dim
        if hidden % p.num_heads:
            raise ValueError(
                f'MultiHeadAttention {p.name!r}: hidden_dim {hidden} is not '
                f'divisible by num_heads {p.num_heads}.'
            )
        self._head_dim = hidden // p.num_heads
        zeros = base_layer.WeightInit.Constant(0.0)
        for name in ('query', 'key', 'value'):
            self.CreateVariable(f'w_{name}', [p.input_dim, hidden])
            if p.bias:
                self.CreateVariable(f'b_{name}', [hidden], init=zeros)
        self.CreateVariable('w_post', [hidden, p.input_dim])
        if p.bias:
            self.CreateVariable('b_post', [p.input_dim], init=zeros)
        self.CreateChild(
            'atten_dropout',
            dropout.DropoutLayer.Params().Set(
                name='atten_dropout', keep_prob=1.0 - p.atten_dropout_prob
            ),
        )

    def _Project(self, x, name):
        """x [B, T, D] -> heads [B, T, N, H] by w_<name> (and b_<name>)."""
        return self._Linear(x, name, [self.params.num_heads, self._head_dim])

    def _Linear(self, x, name, tail):
        """x [B, T, ...] times w_<name> (plus b_<name>) -> [B, T] + tail.

        One 2-D matmul over the B*T rows, not an einsum with B and T as batch dimensions:
        oneDNN runs the latter as a batched matmul it splits over threads, a cost per call
        that dominates tiny micro-batches (docs/engine.md, "the attention's projections")."""
        p = self.params
        b, t = tf.shape(x)[0], tf.shape(x)[1]
        w = self.vars[f'w_{name}']
        y = tf.matmul(tf.reshape(x, [-1, w.shape[0]]), self.CastToFPropDtype(w))
        if p.bias:
            y += self.CastToFPropDtype(self.vars[f'b_{name}'])
        # The tail from the params, not -1: it stays static when B or T is known only at run
        # time (a served model's variable batch).
        return tf.reshape(y, [b, t, *tail])

    def FProp(
        self,
        query_vecs,
        source_vecs=None,
        source_paddings=None,
        query_segment_ids=None,
        source_segment_ids=None,
    ):
        """query_vecs [B, T, D]; source_vecs [B, S, D] (None: self-attention) -> [B, T, D]."""
        p = self.params
        self_attention = source_vecs is None
        query_vecs = tf.cast(query_vecs, self.fprop_dtype)
        source_vecs = query_vecs if self_attention else tf.cast(source_vecs, self.fprop_dtype)
        if self_attention and source_segment_ids is None:
            source_segment_ids = query_segment_ids
        q = self._Project(query_vecs, 'query')
        k = self._Project(source_vecs, 'key')
        v = self._Project(source_vecs, 'value')
        bias = attention_bias(
            tf.shape(q)[1],
            tf.shape(k)[1],
            source_paddings,
            p.causal and self_attention,
            query_segment_ids,
            source_segment_ids,
        )
        return self._Attend(q, k, v, bias)

    def _Attend(self, q, k, v, bias):
        """Heads q [B, T, N, H] attend to k, v [B, S, N, H] under the additive bias -> [B, T, D]."""
        p = self.params
        logits = tf.einsum('btnh,bsnh->bnts', q, k) / tf.cast(math.sqrt(self._head_dim), q.dtype)
        probs = tf.nn.softmax(tf.cast(logits, tf.float32) + bias, axis=-1)
        probs = self.atten_dropout.FProp(tf.cast(probs, self.fprop_dtype))
        context = tf.einsum('bnts,bsnh->btnh', probs, v)
        return self._Linear(context, 'post', [p.input_dim])

    def ExtendStep(self, query_vecs, state, t, max_len, paddings=None):
        """Causal self-attention of positions t.. [B, T, D] over every position decoded so far.

        The state caches keys and values [B, max_len, N, H] and paddings [B, max_len] of the
        positions before t (zeros after them: masked, as the causal mask hides them in FProp).
        Each call projects only its own positions and writes them into the cache.
        """
        p = self.params
        if not p.causal:
            raise ValueError(
                f'MultiHeadAttention {p.name!r}: only causal self-attention decodes step by step '
                '(a non-causal one sees positions not decoded yet).'
            )
        x = tf.cast(query_vecs, self.fprop_dtype)
        q, k, v = (self._Project(x, name) for name in ('query', 'key', 'value'))
        length = tf.shape(x)[1]
        if paddings is None:
            paddings = tf.zeros(tf.shape(x)[:2], tf.float32)
        # [T, max_len]: where each of this call's positions goes in the cache. Adding a one-hot
        # copy to zeros writes the values exactly.
        place = tf.one_hot(t + tf.range(length), max_len, dtype=x.dtype)
        new = NestedMap(
            key=tf.einsum('tl,btnh->blnh', place, k),
            value=tf.einsum('tl,btnh->blnh', place, v),
            paddings=tf.einsum('tl,bt->bl', tf.cast(place, tf.float32), paddings),
        )
        if state is not None:
            new = tf.nest.map_structure(tf.add, state, new)
        causal = tf.range(max_len)[tf.newaxis] <= (t + tf.range(length))[:, tf.newaxis]
        allowed = tf.logical_and(causal[tf.newaxis], (new.paddings < 0.5)[:, tf.newaxis])
        bias = tf.where(allowed[:, tf.newaxis], 0.0, _NEG_INF)  # [B, 1, T, max_len]
        return self._Attend(q, new.key, new.value, bias), new

    def CrossStep(self, query_vecs, state, source_vecs=None, source_paddings=None):
        """Attention of decoded positions to a fixed source (a translation's encoder output):
        the first call (state None) projects the source's keys and values once, into the state;
        later calls read them from it."""
        query_vecs = tf.cast(query_vecs, self.fprop_dtype)
        if state is None:
            source_vecs = tf.cast(source_vecs, self.fprop_dtype)
            state = NestedMap(
                key=self._Project(source_vecs, 'key'),
                value=self._Project(source_vecs, 'value'),
                bias=attention_bias(1, tf.shape(source_vecs)[1], source_paddings),
            )
        q = self._Project(query_vecs, 'query')
        return self._Attend(q, state.key, state.value, state.bias), state

    @classmethod
    def FPropMeta(cls, p, query_shape, source_shape=None):
        query_shape = base_layer.to_shape(query_shape)
        source_shape = base_layer.to_shape(source_shape or query_shape)
        b, t, d = query_shape.as_list()
        s = source_shape[1]
        hidden = p.hidden_dim or p.input_dim
        flops = 2 * b * (t + 2 * s) * d * hidden  # q, k, v projections
        flops += 2 * 2 * b * t * s * hidden  # logits and context
        flops += 2 * b * t * hidden * d  # output projection
        params = 4 * d * hidden + (3 * hidden + d if p.bias else 0)
        # What the backward keeps: q, k, v, the attention probabilities (the softmax's gradient
        # needs its output only: the logits die at the softmax), the context and the output.
        elems = b * (t + 2 * s) * hidden + b * p.num_heads * t * s + b * t * (hidden + d)
        act_bytes = elems * base_layer.dtype_bytes(p.fprop_dtype or p.dtype)
        return base_layer.Meta(flops, query_shape, params, act_bytes)
