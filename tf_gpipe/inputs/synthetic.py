"""Built-in synthetic tasks that a model can learn offline, in minutes, on a CPU."""

import tensorflow as tf

from tf_gpipe.inputs import base_input
from tf_gpipe.nested_map import NestedMap


class SyntheticLm(base_input.BaseInputGenerator):
    """An arithmetic language: sequence i is (start_i + stride_i * t) mod vocab_size.

    start and stride are drawn per sequence (stride in 1..max_stride): the second token is
    guessed right 1/max_stride of the time, every later one is determined by the two before, so
    a model that learns the rule approaches next-token accuracy (seq_len - 1 + 1/max_stride) /
    seq_len. Batches are a pure function of (seed, step).
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('vocab_size', 64, 'Number of token ids.')
        p.Define('seq_len', 32, 'Tokens per example.')
        p.Define('max_stride', 3, 'Strides are drawn from 1..max_stride.')
        return p

    def GetBatch(self, step):
        p = self.params
        seed = tf.stack([tf.constant(p.seed, tf.int64), tf.cast(step, tf.int64)])
        starts = tf.random.stateless_uniform([p.batch_size, 1], seed, 0, p.vocab_size, tf.int64)
        seed2 = tf.random.experimental.stateless_fold_in(seed, 1)
        strides = tf.random.stateless_uniform(
            [p.batch_size, 1], seed2, 1, p.max_stride + 1, tf.int64
        )
        t = tf.range(p.seq_len + 1, dtype=tf.int64)[tf.newaxis]
        tokens = tf.cast((starts + strides * t) % p.vocab_size, tf.int32)
        return NestedMap(
            ids=tokens[:, :-1],
            labels=tokens[:, 1:],
            weights=tf.ones([p.batch_size, p.seq_len], tf.float32),
        )

    def BestAccuracy(self):
        """The accuracy of a model that knows the rule."""
        p = self.params
        return (p.seq_len - 1 + 1.0 / p.max_stride) / p.seq_len
