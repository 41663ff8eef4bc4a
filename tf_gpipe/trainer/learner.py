"""Learner: optimizer, learning-rate schedule, gradient clipping and L2 regularisation."""

import math

import keras
import tensorflow as tf

from tf_gpipe import hyperparams
from tf_gpipe.nested_map import NestedMap
from tf_gpipe.runtime import distribute, placement
from tf_gpipe.trainer import fused_adam

OPTIMIZERS = ('sgd', 'momentum', 'adam', 'rmsprop')
SCHEDULES = ('constant', 'warmup_rsqrt', 'cosine')


class _Schedule(keras.optimizers.schedules.LearningRateSchedule):
    """constant; warmup_rsqrt (linear warm-up, then lr * sqrt(warmup / step)); cosine."""

    def __init__(self, p):
        self._p = p

    def __call__(self, step):
        p = self._p
        step = tf.cast(step, tf.float32) + 1.0
        lr = tf.constant(p.learning_rate, tf.float32)
        warmup = float(max(p.warmup_steps, 0))
        if p.schedule == 'constant':
            factor = tf.minimum(1.0, step / warmup) if warmup else 1.0
        elif p.schedule == 'warmup_rsqrt':
            warm = max(warmup, 1.0)
            factor = tf.minimum(step / warm, tf.math.rsqrt(step / warm))
        else:  # cosine
            total = float(max(p.total_steps, 1))
            progress = tf.clip_by_value((step - warmup) / max(total - warmup, 1.0), 0.0, 1.0)
            factor = 0.5 * (1.0 + tf.cos(math.pi * progress))
            if warmup:
                factor = tf.where(step < warmup, step / warmup, factor)
        return lr * factor

    def get_config(self):
        return {'schedule': self._p.ToText()}


class Learner:
    """Turns gradients into a variable update."""

    @classmethod
    def Params(cls):
        p = hyperparams.InstantiableParams(cls)
        p.Define('optimizer', 'adam', f'One of {OPTIMIZERS}.')
        p.Define('learning_rate', 1e-3, 'Peak learning rate.')
        p.Define('schedule', 'constant', f'One of {SCHEDULES}.')
        p.Define('warmup_steps', 0, 'Linear warm-up steps.')
        p.Define('total_steps', 0, "Steps of the 'cosine' schedule.")
        p.Define('momentum', 0.9, "Momentum of 'momentum' and 'rmsprop'.")
        p.Define('beta1', 0.9, 'Adam beta1.')
        p.Define('beta2', 0.98, 'Adam beta2.')
        p.Define('epsilon', 1e-8, 'Optimizer epsilon.')
        p.Define('clip_gradient_norm', 0.0, 'Clip gradients to this global norm; 0: no clipping.')
        p.Define('l2_regularizer_weight', 0.0, 'L2 weight on variables of regularised layers.')
        return p

    def __init__(self, params):
        p = self.params = params.Copy().Freeze()
        if p.optimizer not in OPTIMIZERS:
            raise ValueError(f'learner.optimizer must be one of {OPTIMIZERS}, got {p.optimizer!r}.')
        if p.schedule not in SCHEDULES:
            raise ValueError(f'learner.schedule must be one of {SCHEDULES}, got {p.schedule!r}.')
        self.schedule = _Schedule(p)
        self._fused = None  # fused_adam.FusedAdam once Build finds a plain Adam
        if p.optimizer == 'sgd':
            self.optimizer = keras.optimizers.SGD(self.schedule)
        elif p.optimizer == 'momentum':
            self.optimizer = keras.optimizers.SGD(self.schedule, momentum=p.momentum)
        elif p.optimizer == 'adam':
            self.optimizer = keras.optimizers.Adam(
                self.schedule, beta_1=p.beta1, beta_2=p.beta2, epsilon=p.epsilon
            )
        else:
            self.optimizer = keras.optimizers.RMSprop(
                self.schedule, momentum=p.momentum, epsilon=p.epsilon
            )

    def Build(self, variables):
        """Creates the optimizer's slots, each on its variable's device."""
        placement.build_optimizer(self.optimizer, variables)
        if fused_adam.applies(self.optimizer):
            self._fused = fused_adam.FusedAdam(self.optimizer, variables)

    def Apply(self, grads, variables, regularized=(), loss=None):
        """Clips, adds L2, applies; returns NestedMap(grad_norm, learning_rate[, finite]).

        With the step's `loss`, the update runs only if the loss and the gradient norm are
        finite (a NaN/Inf in any gradient makes the norm non-finite), so a diverged step
        changes neither weights nor optimizer state; `finite` says whether it ran.
        """
        grads, stats = self.Prepare(grads, variables, regularized)

        def apply():
            self.Update(grads, variables)
            return tf.constant(True)

        if loss is None:
            apply()
        else:
            stats.finite = tf.math.is_finite(loss) & tf.math.is_finite(stats.grad_norm)
            tf.cond(stats.finite, apply, lambda: tf.constant(False))
        return stats

    def Prepare(self, grads, variables, regularized=()):
        """(gradients to apply, NestedMap(grad_norm, learning_rate)): L2 added, clipped.

        Inside `strategy.run` the replicas' shares are first summed by the strategy's
        collective, so L2 and clipping act on the global batch's gradient, as on one device.
        """
        p = self.params
        reg = {v.ref() for v in regularized} if p.l2_regularizer_weight else set()
        # Each gradient's work on its variable's device (on a TF cluster, unplaced, the client
        # would pull every gradient); only one scalar per gradient meets for the global norm.
        devices = [v.device for v in variables]
        dense = []
        for g, v in zip(grads, variables):
            with tf.device(v.device):
                dense.append(tf.convert_to_tensor(g) if g is not None else tf.zeros_like(v))
        if distribute.in_replica_context():
            dense = distribute.all_reduce_sum(dense)
        new_grads = []
        for g, v in zip(dense, variables):
            if v.ref() in reg:
                with tf.device(v.device):
                    g += p.l2_regularizer_weight * v
            new_grads.append(g)
        grads = new_grads
        grad_norm = placement.global_norm(grads, devices)
        if p.clip_gradient_norm:
            grads = placement.clip_by_global_norm(grads, p.clip_gradient_norm, grad_norm, devices)
        lr = self.schedule(self.optimizer.iterations)
        return grads, NestedMap(grad_norm=grad_norm, learning_rate=lr)

    def Update(self, grads, variables):
        """The optimizer's update with prepared (already summed) gradients."""
        if self._fused is not None and not tf.distribute.has_strategy():
            # Adam's update as one fused op per variable (fused_adam.py); under a strategy
            # Keras's apply updates every replica's copy.
            self._fused.Apply(grads, variables, self.schedule(self.optimizer.iterations))
            return
        # Prepare summed the replicas' gradients (before L2 and clipping): not the optimizer
        # again.
        placement.apply_gradients(self.optimizer, zip(grads, variables), summed=True)
