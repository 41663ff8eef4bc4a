"""Token embedding lookup."""

import math

import tensorflow as tf

from tf_gpipe import base_layer


class EmbeddingLayer(base_layer.BaseLayer):
    """ids [...] -> vectors [..., embedding_dim]."""

    _POSITION_WISE = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('vocab_size', 0, 'Number of ids.')
        p.Define('embedding_dim', 0, 'Size of each vector.')
        p.Define('scale_sqrt_depth', False, 'Multiply the vectors by sqrt(embedding_dim).')
        return p

    def __init__(self, params):
        super().__init__(params)
        base_layer.check_positive(self.params, 'vocab_size', 'embedding_dim')
        self.CreateVariable('emb', [self.params.vocab_size, self.params.embedding_dim])

    def FProp(self, ids):
        p = self.params
        y = tf.gather(self.CastToFPropDtype(self.vars.emb), ids)
        if p.scale_sqrt_depth:
            y *= tf.cast(math.sqrt(p.embedding_dim), y.dtype)
        return y

    @classmethod
    def FPropMeta(cls, p, ids):
        ids = base_layer.to_shape(ids)
        n = base_layer.num_elements(ids)
        out = ids.concatenate([p.embedding_dim])
        act_bytes = n * p.embedding_dim * base_layer.dtype_bytes(p.fprop_dtype or p.dtype)
        return base_layer.Meta(n * p.embedding_dim, out, p.vocab_size * p.embedding_dim, act_bytes)


class PositionalEmbeddingLayer(base_layer.BaseLayer):
    """Adds sinusoidal position signals to [B, T, D] vectors (no variables)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('embedding_dim', 0, 'D (must be even).')
        p.Define('max_timescale', 10000.0, 'Longest wavelength.')
        return p

    def __init__(self, params):
        super().__init__(params)
        base_layer.check_positive(self.params, 'embedding_dim')
        if self.params.embedding_dim % 2:
            raise ValueError(
                f'PositionalEmbeddingLayer {self.params.name!r}: embedding_dim '
                f'must be even, got {self.params.embedding_dim}.'
            )

    def Signal(self, length, start=0):
        """[length, D] sinusoids of positions start, start+1, ...: sin on the first half of the
        channels, cos on the second."""
        p = self.params
        half = p.embedding_dim // 2
        positions = tf.cast(tf.range(start, start + length), tf.float32)[:, tf.newaxis]
        rates = tf.exp(-math.log(p.max_timescale) * tf.range(half, dtype=tf.float32) / half)
        angles = positions * rates[tf.newaxis]
        return tf.concat([tf.sin(angles), tf.cos(angles)], axis=1)

    def FProp(self, vecs):
        signal = self.Signal(tf.shape(vecs)[1])
        return vecs + tf.cast(signal, vecs.dtype)[tf.newaxis]

    def ExtendStep(self, vecs, state, t, max_len):
        signal = self.Signal(tf.shape(vecs)[1], t)
        return vecs + tf.cast(signal, vecs.dtype)[tf.newaxis], ()

    @classmethod
    def FPropMeta(cls, p, vecs):
        return base_layer.elementwise_meta(p, vecs, 1, 0, keeps_activations=False)
