"""Built-in synthetic tasks that a model can learn offline, in minutes, on a CPU."""

import tensorflow as tf

from tf_gpipe.inputs import base_input
from tf_gpipe.nested_map import NestedMap


def _step_seed(p, step):
    """The stateless seed of batch `step` (a pure function of the params' seed and the step)."""
    return tf.stack([tf.constant(p.seed, tf.int64), tf.cast(step, tf.int64)])


_fold = tf.random.experimental.stateless_fold_in


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
        seed = _step_seed(p, step)
        starts = tf.random.stateless_uniform([p.batch_size, 1], seed, 0, p.vocab_size, tf.int64)
        seed2 = _fold(seed, 1)
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


class SyntheticMt(base_input.BaseInputGenerator):
    """Multilingual 'translation' offline: the target language token says copy or reverse.

    Token 0 is padding, 1 and 2 are the target-language tokens (1: copy, 2: reverse the
    source), 3.. are words. Sources have random lengths in [min_len, seq_len] (paddings mark the
    rest). Decoder input = [language token] + target[:-1]; labels = target, then the end token
    0 (weighted) where the length leaves room.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('vocab_size', 32, 'Ids, including pad and the two language tokens.')
        p.Define('seq_len', 12, 'Maximum source / target length.')
        p.Define('min_len', 4, 'Minimum source length.')
        return p

    def GetBatch(self, step):
        p = self.params
        seed = _step_seed(p, step)
        words = tf.random.stateless_uniform(
            [p.batch_size, p.seq_len], seed, 3, p.vocab_size, tf.int32
        )
        lengths = tf.random.stateless_uniform(
            [p.batch_size], _fold(seed, 1), p.min_len, p.seq_len + 1, tf.int32
        )
        reverse = tf.random.stateless_uniform([p.batch_size], _fold(seed, 2), 0, 2, tf.int32)
        mask = tf.sequence_mask(lengths, p.seq_len)
        src = tf.where(mask, words, 0)
        reversed_src = tf.reverse_sequence(src, lengths, seq_axis=1, batch_axis=0)
        tgt = tf.where(reverse[:, None] > 0, reversed_src, src)
        lang = 1 + reverse
        tgt_in = tf.concat([lang[:, None], tgt[:, :-1]], axis=1)
        # The target ends with the end token 0 (the padding id) where it fits: a decoder learns
        # where to stop.
        tgt_mask = tf.sequence_mask(lengths + 1, p.seq_len)
        weights = tf.cast(tgt_mask, tf.float32)
        return NestedMap(
            src_ids=src,
            src_paddings=1.0 - tf.cast(mask, tf.float32),
            tgt_ids=tf.where(tgt_mask, tgt_in, 0),
            tgt_paddings=1.0 - weights,
            labels=tgt,
            weights=weights,
        )


class SyntheticShapes(base_input.BaseInputGenerator):
    """Procedurally drawn images: class 0 horizontal bar, 1 vertical bar, 2 box, 3 diagonal,
    at a random place, with Gaussian noise. Batches are a pure function of (seed, step)."""

    NUM_CLASSES = 4

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('image_size', 16, 'Height and width.')
        p.Define('channels', 3, 'Channels (all carry the same drawing).')
        p.Define('noise', 0.3, 'Standard deviation of the added noise.')
        return p

    def GetBatch(self, step):
        p = self.params
        seed = _step_seed(p, step)
        size, radius = p.image_size, max(p.image_size // 4, 2)
        labels = tf.random.stateless_uniform([p.batch_size], seed, 0, self.NUM_CLASSES, tf.int32)
        centre = tf.random.stateless_uniform(
            [p.batch_size, 2], _fold(seed, 1), radius, size - radius, tf.int32
        )
        grid = tf.range(size)
        dy = tf.abs(grid[None, :, None] - centre[:, 0, None, None])
        dx = tf.abs(grid[None, None, :] - centre[:, 1, None, None])
        signed = (grid[None, :, None] - centre[:, 0, None, None]) - (
            grid[None, None, :] - centre[:, 1, None, None]
        )
        shapes = tf.stack(
            [
                (dy <= 0) & (dx <= radius),
                (dx <= 0) & (dy <= radius),
                tf.maximum(dx, dy) <= radius // 2,
                (tf.abs(signed) <= 0) & (dy <= radius),
            ],
            axis=1,
        )
        mask = tf.gather(shapes, labels, axis=1, batch_dims=1)
        images = tf.cast(mask, tf.float32)[..., None] * tf.ones([p.channels])
        images += p.noise * tf.random.stateless_normal(tf.shape(images), _fold(seed, 2))
        return NestedMap(images=images, labels=labels)
