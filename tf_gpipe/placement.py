"""Keep optimizer state, and the optimizer's work, next to the variables it updates.

A Keras 3 optimizer creates its slot variables (momentum, velocity, ...) under the device scope
that is current when it is built, and computes each update under the scope current when it is
applied: with the cells' variables on K devices (or K worker processes) both would land on one
device — on a TF cluster the client — and every step would ship gradients and slots across.
`build_optimizer` builds it with each slot on its variable's device and makes each variable's
update, weight decay and gradient clipping run on that device.
"""

import tensorflow as tf


def device_of(variable):
    """The device of a tf.Variable, a keras.Variable (its .value) or a tensor; '' if none."""
    value = getattr(variable, 'value', None)
    if value is not None and not callable(value):  # keras.Variable -> tf.Variable
        variable = value
    return getattr(variable, 'device', '') or ''


def _chain(optimizer):
    """The optimizer and the ones it wraps (LossScaleOptimizer -> its inner optimizer)."""
    chain = [optimizer]
    while getattr(chain[-1], 'inner_optimizer', None) is not None:
        chain.append(chain[-1].inner_optimizer)
    return chain


def build_optimizer(optimizer, variables):
    """Builds `optimizer` for `variables`: slots and update work on each variable's device."""
    variables = list(variables)
    for opt in _chain(optimizer):
        colocate_updates(opt)
    if optimizer.built:
        return optimizer
    # A wrapper (LossScaleOptimizer) builds its inner optimizer, which makes the slots.
    chain = _chain(optimizer)
    for opt in chain:
        opt.add_variable_from_reference = _colocated(opt.add_variable_from_reference)
    try:
        with tf.init_scope():
            optimizer.build(variables)
    finally:
        for opt in chain:
            del opt.add_variable_from_reference
    return optimizer


def _colocated(add_variable_from_reference):
    def colocated(reference_variable, *args, **kwargs):
        with tf.device(device_of(reference_variable)):
            return add_variable_from_reference(reference_variable, *args, **kwargs)

    return colocated


def colocate_updates(optimizer):
    """Runs `optimizer`'s per-variable work on each variable's (and gradient's) device.

    Keras computes updates under the caller's device scope. Here `update_step` and weight
    decay run on the variable's device, clipping on each gradient's device (a global norm
    adds one scalar per gradient), and the single-replica all-reduce (an identity) is skipped.
    Idempotent.
    """
    if getattr(optimizer, '_tf_gpipe_colocated', False):
        return optimizer
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
        # With no tf.distribute strategy there is one replica and Keras's all-reduce is an
        # identity — but one IdentityN op over every gradient, placed on a single device
        # (a cluster's client): every gradient would travel there and back.
        if not tf.distribute.has_strategy() or getattr(optimizer, '_tf_gpipe_summed', False):
            return list(grads_and_vars)
        return all_reduce(grads_and_vars)

    optimizer.update_step = colocated_update_step
    if all_reduce is not None:
        optimizer._all_reduce_sum_gradients = all_reduce_across_replicas
    optimizer._apply_weight_decay = colocated_weight_decay
    optimizer._clip_gradients = colocated_clip
    optimizer._tf_gpipe_colocated = True
    return optimizer


def gradients_already_summed(optimizer):
    """Marks `optimizer` (built by build_optimizer) as applying gradients that are already
    summed over a strategy's replicas, so its own all-reduce is skipped."""
    for opt in _chain(optimizer):
        opt._tf_gpipe_summed = True
    return optimizer


def global_norm(grads, devices=None):
    """The global L2 norm of `grads`, each gradient's share computed on its device.

    `devices[i]` (e.g. its variable's) places gradient i's work, else the gradient's own;
    only one scalar per gradient meets for the sum.
    """
    squares = []
    for g, device in zip(grads, devices or [None] * len(grads)):
        if g is not None:
            with tf.device(device or device_of(g)):
                squares.append(tf.reduce_sum(tf.square(tf.cast(g, tf.float32))))
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
            out.append(g * tf.cast(scale, g.dtype))
    return out
