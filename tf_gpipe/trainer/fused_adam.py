"""Keras Adam's update as TF's fused Adam kernel: one op per variable, on its device.

The learner's optimizer is a `keras.optimizers.Adam`, whose slots are what checkpoints hold.
Keras's `Adam.update_step` builds about a dozen ops per variable; tracing and compiling them
was about 1.7 s of the demo's first step (69 variables). `FusedAdam` applies the same update
to the same slots with `tf.raw_ops.ResourceApplyAdam`:

    m += (g - m)(1 - b1);  v += (g^2 - v)(1 - b2);  var -= m * a / (sqrt(v) + eps),
    a = lr * sqrt(1 - b2^t) / (1 - b1^t),  t = iterations + 1,

then counts the step as Keras does (`iterations += 1`). The kernel computes 1 - b in the
variable's dtype, Keras in Python floats: the results differ by float rounding only
(tests/test_learner.py pins them within 1e-6 of Keras's over several steps).

Only a plain Adam outside a tf.distribute strategy runs here (the learner checks `applies`);
under a strategy Keras's own apply updates each replica's copy.
"""

import keras
import tensorflow as tf

from tf_gpipe.runtime import placement
from tf_gpipe.runtime.variables import backing
from tf_gpipe.trainer import checkpoints


def applies(optimizer):
    """Whether `optimizer` is an Adam whose every step FusedAdam computes as Keras would."""
    return (
        type(optimizer) is keras.optimizers.Adam
        and not optimizer.amsgrad
        and not optimizer.use_ema
        and not optimizer.gradient_accumulation_steps
        and optimizer.weight_decay is None
        and optimizer.clipnorm is None
        and optimizer.clipvalue is None
        and optimizer.global_clipnorm is None
        and optimizer.loss_scale_factor is None
    )


class FusedAdam:
    """Applies `optimizer` (a built Adam, `applies`) to `variables` with the fused kernel."""

    def __init__(self, optimizer, variables):
        self.optimizer = optimizer
        slots, _ = checkpoints.optimizer_slots(optimizer, list(variables))
        missing = [v.name for v, s in zip(variables, slots) if set(s) != {'momentum', 'velocity'}]
        if missing:
            raise RuntimeError(
                f'Adam has no momentum and velocity slots for {missing[:3]}: build the optimizer '
                'for these variables first (Learner.Build).'
            )
        self._slots = {v.ref(): (s['momentum'], s['velocity']) for v, s in zip(variables, slots)}

    def Apply(self, grads, variables, learning_rate):
        """One Adam step of `variables` by dense `grads` at `learning_rate` (Keras's schedule
        value at `iterations`); returns the op that counts the step."""
        opt = self.optimizer
        step = opt.iterations + 1
        per_device = {}  # (device, dtype) -> the step's constants there, computed once
        for g, var in zip(grads, variables):
            m, v = self._slots[var.ref()]
            device, dtype = placement.device_of(var), var.dtype
            with tf.device(device):
                if (device, dtype) not in per_device:
                    t = tf.cast(step, dtype)
                    b1, b2 = tf.cast(opt.beta_1, dtype), tf.cast(opt.beta_2, dtype)
                    per_device[(device, dtype)] = dict(
                        beta1_power=tf.pow(b1, t),
                        beta2_power=tf.pow(b2, t),
                        lr=tf.cast(learning_rate, dtype),
                        beta1=b1,
                        beta2=b2,
                        epsilon=tf.cast(opt.epsilon, dtype),
                    )
                tf.raw_ops.ResourceApplyAdam(
                    var=backing(var).handle,
                    m=backing(m).handle,
                    v=backing(v).handle,
                    grad=tf.cast(g, dtype),
                    **per_device[(device, dtype)],
                )
        return opt.iterations.assign_add(1)
