"""Keep optimizer state, and the optimizer's work, next to the variables it updates.

A Keras 3 optimizer creates each slot variable (momentum, velocity, ...) colocated with its
variable, but computes each update under the device scope that is current when it is applied:
with the cells' variables on K devices (or K worker processes) the update math would land on one
device — on a TF cluster the client — and every step would ship gradients and updates across.
`apply_gradients` applies with each variable's update, weight decay and gradient clipping on
that variable's device. It leaves the optimizer as it found it: the hooks that place the work
are on the instance only while it applies (no public Keras API places per-variable work; see
the private-API table in docs/private-apis.md), and each calls Keras's own method, so the numbers are Keras's.
"""

import contextlib

import tensorflow as tf

from tf_gpipe.runtime.variables import backing

# The optimizer methods `colocated` wraps, each calling the instance's own.
_HOOKED = ('update_step', '_apply_weight_decay', '_clip_gradients', '_all_reduce_sum_gradients')


def device_of(variable):
    """The device of a tf.Variable, a keras.Variable (its .value) or a tensor; '' if none."""
    return getattr(backing(variable), 'device', '') or ''


def _chain(optimizer):
    """The optimizer and the ones it wraps (LossScaleOptimizer -> its inner optimizer)."""
    chain = [optimizer]
    while getattr(chain[-1], 'inner_optimizer', None) is not None:
        chain.append(chain[-1].inner_optimizer)
    return chain


def build_optimizer(optimizer, variables):
    """Builds `optimizer` for `variables` outside any function (Keras colocates each slot with
    its variable: tests/test_placement.py pins it); a built one is returned as it is."""
    if not optimizer.built:
        with tf.init_scope():
            optimizer.build(list(variables))
    return optimizer


def apply_gradients(optimizer, grads_and_vars, summed=False):
    """`optimizer.apply_gradients(grads_and_vars)` with each variable's work on its device.

    summed: the gradients are already summed over a tf.distribute strategy's replicas, so
    the optimizer's own all-reduce is skipped.
    """
    with colocated(optimizer, summed):
        return optimizer.apply_gradients(grads_and_vars)


@contextlib.contextmanager
def colocated(optimizer, summed=False):
    """Within: `optimizer`'s per-variable work runs on each variable's (and gradient's) device.

    `update_step` and weight decay run on the variable's device, clipping on each gradient's
    device (a global norm adds one scalar per gradient, each gradient squared as Keras does:
    an IndexedSlices by its slices), and the single-replica all-reduce (an identity, but one
    op over every gradient, on one device) is skipped. On exit the instance is as before.
    """
    chain = _chain(optimizer)
    saved = [{n: opt.__dict__[n] for n in _HOOKED if n in opt.__dict__} for opt in chain]
    for opt in chain:
        _install(opt, summed)
    try:
        yield optimizer
    finally:
        for opt, before in zip(chain, saved):
            for name in _HOOKED:
                if name in opt.__dict__:
                    delattr(opt, name)
            for name, value in before.items():
                setattr(opt, name, value)


def _install(optimizer, summed):
    update_step = optimizer.update_step
    all_reduce = getattr(optimizer, '_all_reduce_sum_gradients', None)  # TF backend only
    apply_weight_decay = optimizer._apply_weight_decay
    clip_gradients = optimizer._clip_gradients

    def colocated_update_step(gradient, variable, learning_rate):
        with tf.device(device_of(variable)):
            return update_step(gradient, variable, learning_rate)

    def colocated_weight_decay(variables):
        for variable in variables:
            with tf.device(device_of(variable)):
                apply_weight_decay([variable])

    def colocated_clip(grads):
        norm = optimizer.global_clipnorm
        if not (norm and norm > 0) or optimizer.clipnorm or optimizer.clipvalue:
            out = []
            for g in grads:
                with tf.device(device_of(g)):
                    out.append(clip_gradients([g])[0])
            return out
        return clip_by_global_norm(grads, norm)

    def all_reduce_across_replicas(grads_and_vars):
        if not tf.distribute.has_strategy() or summed:
            return list(grads_and_vars)
        return all_reduce(grads_and_vars)

    optimizer.update_step = colocated_update_step
    if all_reduce is not None:
        optimizer._all_reduce_sum_gradients = all_reduce_across_replicas
    optimizer._apply_weight_decay = colocated_weight_decay
    optimizer._clip_gradients = colocated_clip


def global_norm(grads, devices=None):
    """The global L2 norm of `grads`, each gradient's share computed on its device.

    `devices[i]` (e.g. its variable's) places gradient i's work, else the gradient's own;
    only one scalar per gradient meets for the sum.
    """
    squares = []
    for g, device in zip(grads, devices or [None] * len(grads)):
        if g is not None:
            with tf.device(device or device_of(g)):
                # As Keras (and tf.linalg.global_norm): an IndexedSlices by its slices, a row
                # that several slices update counted once per slice.
                values = g.values if isinstance(g, tf.IndexedSlices) else g
                squares.append(tf.reduce_sum(tf.square(tf.cast(values, tf.float32))))
    return tf.sqrt(tf.add_n(squares))


def clip_by_global_norm(grads, clip_norm, norm=None, devices=None):
    """tf/Keras clip_by_global_norm, each gradient scaled on its device (as `global_norm`)."""
    if norm is None:
        norm = global_norm(grads, devices)
    # As tf and Keras: clip / max(norm, clip), a no-op below clip_norm, NaN for a non-finite norm.
    scale = clip_norm * tf.minimum(1.0 / norm, 1.0 / clip_norm) + (norm - norm)
    out = []
    for g, device in zip(grads, devices or [None] * len(grads)):
        if g is None:
            out.append(None)
            continue
        with tf.device(device or device_of(g)):
            out.append(g * tf.cast(scale, g.dtype))  # as Keras: an IndexedSlices made dense
    return out
