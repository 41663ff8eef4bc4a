"""Dropout with replayable masks."""

import tensorflow as tf

from tf_gpipe import base_layer, fprop_context


class DropoutLayer(base_layer.BaseLayer):
    """Keeps each element with probability keep_prob (scaled by 1/keep_prob) in training.

    The mask is a stateless function of (random_seed, layer name path, step, seed_offset), the
    last two read from `fprop_context`: a pipeline replays the exact forward mask when it
    recomputes a micro-batch, and results do not depend on how the model is cut into cells.
    Outside any context step, the layer counts its own training calls instead.
    """

    _POSITION_WISE = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('keep_prob', 1.0, 'Probability of keeping an element.')
        p.Define('noise_shape', None, 'Mask shape broadcast against the input (None: same).')
        return p

    def __init__(self, params):
        super().__init__(params)
        if not 0.0 < self.params.keep_prob <= 1.0:
            raise ValueError(
                f'DropoutLayer {self.params.name!r}: keep_prob must be in (0, 1], '
                f'got {self.params.keep_prob}.'
            )
        self._seed = base_layer.variable_seed(self._base_seed, f'{self.seed_name}/dropout')
        if self.params.keep_prob < 1.0:
            self.CreateVariable(
                'call_count',
                [],
                init=base_layer.WeightInit.Constant(0),
                dtype=tf.int64,
                trainable=False,
            )

    def Mask(self, shape):
        """The keep-mask (0/1) this call would use, for the current context."""
        ctx = fprop_context.current()
        if ctx.step is not None:
            step = tf.cast(ctx.step, tf.int64)
        else:
            count = self.vars.call_count
            step = count - 1 if ctx.recompute else count.assign_add(1) - 1
        seed = tf.random.experimental.stateless_fold_in(self._seed, step)
        seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(ctx.seed_offset, tf.int64))
        return tf.random.stateless_uniform(shape, seed) < self.params.keep_prob

    def FProp(self, inputs):
        p = self.params
        x = tf.cast(inputs, self.fprop_dtype)
        if p.keep_prob == 1.0 or not fprop_context.current().training:
            return x
        shape = p.noise_shape if p.noise_shape is not None else tf.shape(x)
        mask = tf.cast(self.Mask(shape), x.dtype)
        return x * mask / tf.cast(p.keep_prob, x.dtype)

    @classmethod
    def FPropMeta(cls, p, inputs):
        active = p.keep_prob < 1
        return base_layer.elementwise_meta(p, inputs, 2 if active else 0, 0, active)
