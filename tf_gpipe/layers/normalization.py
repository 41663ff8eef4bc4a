"""Batch normalisation and layer normalisation."""

import tensorflow as tf

from tf_gpipe import base_layer, fprop_context

_ZEROS = base_layer.WeightInit.Constant(0.0)
_ONES = base_layer.WeightInit.Constant(1.0)


class BatchNormLayer(base_layer.BaseLayer):
    """Batch norm over all but the last dimension.

    Training normalises with the statistics of the batch it is given (for a pipeline: the
    micro-batch) and adds that batch's sums to per-step accumulators; `PostTrainingStepUpdate`
    then moves the moving averages once, with the statistics of everything seen during the step
    (the whole mini-batch), and clears the accumulators. Forwards marked as recompute add nothing.
    Eval normalises with the moving averages.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('dim', 0, 'Size of the last (channel) dimension.')
        p.Define('decay', 0.999, 'Moving-average decay.')
        p.Define('epsilon', 1e-3, 'Added to the variance.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        base_layer.check_positive(p, 'dim')
        self.CreateVariable('beta', [p.dim], init=_ZEROS)
        self.CreateVariable('gamma', [p.dim], init=_ONES)
        stat = dict(dtype=tf.float32, trainable=False)
        self.CreateVariable('moving_mean', [p.dim], init=_ZEROS, **stat)
        self.CreateVariable('moving_variance', [p.dim], init=_ONES, **stat)
        # Sums of (x - moving_mean) and its square: shifting by the moving mean keeps
        # E[x^2] - E[x]^2 accurate in float32.
        self.CreateVariable('acc_count', [], init=_ZEROS, **stat)
        self.CreateVariable('acc_sum', [p.dim], init=_ZEROS, **stat)
        self.CreateVariable('acc_sum_sq', [p.dim], init=_ZEROS, **stat)

    def FProp(self, inputs):
        p = self.params
        ctx = fprop_context.current()
        x = tf.cast(inputs, tf.float32)
        axes = list(range(inputs.shape.rank - 1))
        v = self.vars
        if ctx.training:
            mean, variance = tf.nn.moments(x, axes)
            if not ctx.recompute:
                shifted = x - v.moving_mean
                count = tf.cast(tf.size(x) // p.dim, tf.float32)
                v.acc_count.assign_add(count)
                v.acc_sum.assign_add(tf.reduce_sum(shifted, axes))
                v.acc_sum_sq.assign_add(tf.reduce_sum(tf.square(shifted), axes))
        else:
            mean, variance = v.moving_mean, v.moving_variance
        y = tf.nn.batch_normalization(x, mean, variance, v.beta, v.gamma, p.epsilon)
        return tf.cast(y, self.fprop_dtype)

    def StepStatistics(self):
        """(mean, variance) of everything accumulated since the last update."""
        v = self.vars
        count = tf.maximum(v.acc_count, 1.0)
        shifted_mean = v.acc_sum / count
        variance = tf.maximum(v.acc_sum_sq / count - tf.square(shifted_mean), 0.0)
        return v.moving_mean + shifted_mean, variance

    def PostTrainingStepUpdate(self):
        v = self.vars
        mean, variance = self.StepStatistics()
        # Nothing seen, or a diverged step's statistics: keep the averages (and clear).
        seen = (v.acc_count > 0) & tf.math.is_finite(mean) & tf.math.is_finite(variance)
        decay = self.params.decay
        v.moving_mean.assign(
            tf.where(seen, decay * v.moving_mean + (1 - decay) * mean, v.moving_mean)
        )
        v.moving_variance.assign(
            tf.where(seen, decay * v.moving_variance + (1 - decay) * variance, v.moving_variance)
        )
        for name in ('acc_count', 'acc_sum', 'acc_sum_sq'):
            v[name].assign(tf.zeros_like(v[name]))
        super().PostTrainingStepUpdate()

    @classmethod
    def FPropMeta(cls, p, inputs):
        return base_layer.elementwise_meta(p, inputs, 8, 2 * p.dim)


class LayerNorm(base_layer.BaseLayer):
    """Layer norm over the last dimension, with a learnt scale and bias."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Size of the last dimension.')
        p.Define('epsilon', 1e-6, 'Added to the variance.')
        return p

    def __init__(self, params):
        super().__init__(params)
        base_layer.check_positive(self.params, 'input_dim')
        self.CreateVariable('scale', [self.params.input_dim], init=_ONES)
        self.CreateVariable('bias', [self.params.input_dim], init=_ZEROS)

    def FProp(self, inputs):
        x = tf.cast(inputs, tf.float32)
        mean, variance = tf.nn.moments(x, [-1], keepdims=True)
        y = (x - mean) * tf.math.rsqrt(variance + self.params.epsilon)
        y = y * tf.cast(self.vars.scale, tf.float32) + tf.cast(self.vars.bias, tf.float32)
        return tf.cast(y, self.fprop_dtype)

    @classmethod
    def FPropMeta(cls, p, inputs):
        return base_layer.elementwise_meta(p, inputs, 8, 2 * p.input_dim)
