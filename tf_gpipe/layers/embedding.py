"""Token embedding lookup."""

import math

import tensorflow as tf

from tf_gpipe import base_layer


class EmbeddingLayer(base_layer.BaseLayer):
    """ids [...] -> vectors [..., embedding_dim]."""

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
