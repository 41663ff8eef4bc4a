"""Keras layers with randomness or batch statistics, made safe to recompute and to micro-batch.

(And max pooling made fast in a kept micro-batch's backward: `recomputing_max_pools`.)

Two Keras behaviours break a pipeline's exactness, and this module fixes each for a wrapped
Keras layer (and every layer nested in it):

- Random layers (Dropout, GaussianNoise, ...) draw from a `SeedGenerator` whose state advances
  on every call, so a recompute would draw a new mask. `replay_seeds` sets each generator's
  counter from (step, micro-batch) before a call: the forward and its recompute draw the same
  numbers, and every step and micro-batch still draws different ones.
- BatchNormalization moves its moving averages on every training call: M times per step (plus
  the recomputes), each from one micro-batch. `BatchNormStats` takes over its training call:
  it normalises with the micro-batch's statistics exactly as Keras does, adds the micro-batch's
  sums to accumulators (not in a recompute), and `apply()` moves the averages once per step
  with the statistics of the whole batch.
"""

import functools

import keras
import tensorflow as tf

from tf_gpipe import fprop_context
from tf_gpipe.layers import normalization, pooling

# A call's counter is (step * _MAX_MICRO_BATCHES + micro_batch) * _DRAWS_PER_CALL: room for
# that many draws per generator per call before two calls could share a seed.
_MAX_MICRO_BATCHES = 1 << 12
_DRAWS_PER_CALL = 1 << 16


def sublayers(layer):
    """`layer` and every Keras layer nested in it."""
    return list(layer._flatten_layers(include_self=True, recursive=True))


def seed_generators(layer):
    """The SeedGenerators of `layer` and its nested layers."""
    out = []
    for sub in sublayers(layer):
        for gen in getattr(sub, '_seed_generators', []):
            if all(gen is not g for g in out):
                out.append(gen)
    return out


def replay_seeds(generators):
    """Sets every generator's counter from the current step and micro-batch (if any)."""
    ctx = fprop_context.current()
    if ctx.step is None or not generators:
        return
    step = tf.cast(ctx.step, tf.int64)
    micro = tf.cast(ctx.seed_offset, tf.int64)
    counter = (step * _MAX_MICRO_BATCHES + micro) * _DRAWS_PER_CALL
    for gen in generators:
        state = gen.state
        seed = tf.cast(state.value[0], tf.int64)
        state.assign(tf.cast(tf.stack([seed, counter]), state.dtype))


class BatchNormStats:
    """Micro-batch training calls and one moving-average update per step for a Keras BN layer.

    Installs itself as the layer's `call` (the layer object and its weights stay Keras'), so
    it also works for a BatchNormalization nested inside another Keras layer. Outside
    training it defers to Keras' own call.
    """

    def __init__(self, layer):
        if layer.renorm:
            raise ValueError(
                f'BatchNormalization {layer.name!r} uses renorm=True, whose moving statistics '
                'cannot be pooled over micro-batches; use renorm=False in a pipeline.'
            )
        self.layer = layer
        self._keras_call = layer.call
        shape = tuple(layer.moving_mean.shape)
        with tf.init_scope(), tf.device(layer.moving_mean.value.device):
            # normalization.accumulate_step's (count, sum, sum of squares) of x - moving_mean;
            # per replica under a tf.distribute strategy, summed over replicas when read in
            # cross-replica context (the once-per-step update).
            local = dict(
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM,
            )
            self._count = tf.Variable(0.0, name=f'{layer.name}_acc_count', **local)
            self._sum = tf.Variable(tf.zeros(shape), name=f'{layer.name}_acc_sum', **local)
            self._sum_sq = tf.Variable(tf.zeros(shape), name=f'{layer.name}_acc_sum_sq', **local)
        layer.call = self.call

    @property
    def accumulators(self):
        return [self._count, self._sum, self._sum_sq]

    def call(self, inputs, training=None, mask=None):
        layer = self.layer
        if not (training and layer.trainable):
            return self._keras_call(inputs, training=training, mask=mask)
        if mask is not None:
            raise ValueError(
                f'BatchNormalization {layer.name!r} got a mask; masked batch statistics are not '
                'supported in a pipeline.'
            )
        # Keras' own training computation, minus its per-call moving-average update.
        x = tf.cast(inputs, keras.backend.result_type(inputs.dtype, 'float32'))
        mean, variance = layer._moments(x, None)
        gamma = tf.cast(layer.gamma, x.dtype) if layer.scale else None
        beta = tf.cast(layer.beta, x.dtype) if layer.center else None
        if not fprop_context.current().recompute:
            self._Accumulate(x)
        out = keras.ops.batch_normalization(
            x, mean, variance, axis=layer.axis, offset=beta, scale=gamma, epsilon=layer.epsilon
        )
        return tf.cast(out, layer.compute_dtype)

    def _Accumulate(self, x):
        layer = self.layer
        shape = [1] * x.shape.rank
        shape[layer.axis] = x.shape[layer.axis]
        moving_mean = tf.reshape(tf.cast(layer.moving_mean, x.dtype), shape)
        normalization.accumulate_step(
            self.accumulators, x, moving_mean, list(layer._reduction_axes)
        )

    def apply(self):
        """Moves the averages with the step's pooled statistics (if any), then clears them."""
        layer = self.layer
        mean, variance = normalization.moved_averages(
            tf.cast(layer.moving_mean, tf.float32),
            tf.cast(layer.moving_variance, tf.float32),
            self.accumulators,
            layer.momentum,
        )
        layer.moving_mean.assign(tf.cast(mean, layer.moving_mean.dtype))
        layer.moving_variance.assign(tf.cast(variance, layer.moving_variance.dtype))
        for acc in self.accumulators:
            acc.assign(tf.zeros_like(acc))


def recomputing_max_pools(layer):
    """Gives every channels-last MaxPooling2D in `layer` (nested ones included) a call whose
    gradient recomputes the pooling (`layers.pooling.max_pool`): same values, and on CPU a kept
    micro-batch's backward, a function of its own, keeps oneDNN's fast MaxPoolGrad (which needs
    its MaxPool in the same graph) instead of Eigen's. Returns the layers it changed."""
    pools = []
    for sub in sublayers(layer):
        if isinstance(sub, keras.layers.MaxPooling2D) and sub.data_format == 'channels_last':
            sub.call = functools.partial(_max_pool_call, sub)
            pools.append(sub)
    return pools


def _max_pool_call(layer, inputs):
    return pooling.max_pool(
        inputs, tuple(layer.pool_size), tuple(layer.strides), layer.padding.upper()
    )


def batch_norm_stats(layer):
    """A BatchNormStats for every BatchNormalization in `layer` (nested ones included)."""
    return [
        BatchNormStats(sub)
        for sub in sublayers(layer)
        if isinstance(sub, keras.layers.BatchNormalization)
    ]
