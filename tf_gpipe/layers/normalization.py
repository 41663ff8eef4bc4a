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
        # Under a tf.distribute strategy each replica sums its own micro-batches; read in
        # cross-replica context (the once-per-step update) they are summed over replicas.
        stat.update(
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )
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
                accumulate_step(self._Accumulators(), x, v.moving_mean, axes)
        else:
            mean, variance = v.moving_mean, v.moving_variance
        y = tf.nn.batch_normalization(x, mean, variance, v.beta, v.gamma, p.epsilon)
        return tf.cast(y, self.fprop_dtype)

    def _Accumulators(self):
        v = self.vars
        return v.acc_count, v.acc_sum, v.acc_sum_sq

    def StepStatistics(self):
        """(mean, variance) of everything accumulated since the last update."""
        return step_statistics(self.vars.moving_mean, self._Accumulators())

    def ReplicaSums(self):
        return list(self._Accumulators())

    def PostTrainingStepUpdate(self):
        v = self.vars
        mean, variance = moved_averages(
            v.moving_mean, v.moving_variance, self._Accumulators(), self.params.decay
        )
        v.moving_mean.assign(mean)
        v.moving_variance.assign(variance)
        for acc in self._Accumulators():
            acc.assign(tf.zeros_like(acc))
        super().PostTrainingStepUpdate()

    @classmethod
    def FPropMeta(cls, p, inputs):
        return base_layer.elementwise_meta(p, inputs, 8, 2 * p.dim)


class LayerNorm(base_layer.BaseLayer):
    """Layer norm over the last dimension, with a learnt scale and bias."""

    _POSITION_WISE = True

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


# ---- per-step batch statistics, shared with Keras' BatchNormalization (keras_state) ---------


def accumulate_step(accumulators, x, moving_mean, axes):
    """Adds x to (count, sum, sum of squares) of x - moving_mean over `axes`.

    Shifting by the moving mean, constant within a step, keeps E[x^2] - E[x]^2 accurate in
    float32. `moving_mean` broadcasts against x; the sums have the accumulators' shape.
    """
    count, shifted_sum, shifted_sum_sq = accumulators
    shifted = x - moving_mean
    count.assign_add(tf.cast(tf.size(x) // tf.size(moving_mean), tf.float32))
    shifted_sum.assign_add(tf.reshape(tf.reduce_sum(shifted, axes), shifted_sum.shape))
    shifted_sum_sq.assign_add(
        tf.reshape(tf.reduce_sum(tf.square(shifted), axes), shifted_sum.shape)
    )


def step_statistics(moving_mean, accumulators):
    """(mean, variance) of everything `accumulate_step` added since the accumulators were 0."""
    count, shifted_sum, shifted_sum_sq = accumulators
    count = tf.maximum(count, 1.0)
    shifted_mean = shifted_sum / count
    variance = tf.maximum(shifted_sum_sq / count - tf.square(shifted_mean), 0.0)
    return moving_mean + shifted_mean, variance


def moved_averages(moving_mean, moving_variance, accumulators, decay):
    """The averages moved once with the step's statistics; unchanged when the step saw
    nothing, or diverged (non-finite statistics)."""
    mean, variance = step_statistics(moving_mean, accumulators)
    seen = (accumulators[0] > 0) & tf.math.is_finite(mean) & tf.math.is_finite(variance)
    return (
        tf.where(seen, decay * moving_mean + (1 - decay) * mean, moving_mean),
        tf.where(seen, decay * moving_variance + (1 - decay) * variance, moving_variance),
    )
