"""Keep optimizer state next to the variables it updates.

A Keras 3 optimizer creates its slot variables (momentum, velocity, ...) under the device scope
that is current when it is built: with the cells' variables on K devices (or K worker
processes) they would all land on the client, and every step would ship gradients and slots
across. `build_optimizer` builds it with each slot on its variable's device; Keras already
runs each variable's update colocated with the variable.
"""

import tensorflow as tf


def _device_of(variable):
    value = getattr(variable, 'value', variable)  # keras.Variable -> tf.Variable
    return getattr(value, 'device', '') or ''


def build_optimizer(optimizer, variables):
    """Builds `optimizer` for `variables` with every slot on its variable's device."""
    variables = list(variables)
    if optimizer.built:
        return optimizer
    # A wrapper (LossScaleOptimizer) builds its inner optimizer, which makes the slots.
    chain = [optimizer]
    while getattr(chain[-1], 'inner_optimizer', None) is not None:
        chain.append(chain[-1].inner_optimizer)
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
        with tf.device(_device_of(reference_variable)):
            return add_variable_from_reference(reference_variable, *args, **kwargs)

    return colocated
