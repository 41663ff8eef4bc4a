"""Arguments of the cells' calls that Grappler cannot prove constant.

Grappler's function optimizer gives a function call a copy of the function of its own for
every argument it can prove constant (one copy per distinct constant), then optimises and
instantiates each copy at the first run. A per-micro-batch constant argument (d loss = 1, a
zero gradient, a batch of ones cut into M micro-batches, a micro-batch's number) therefore made
each micro-batch's call a function of its own, and the first run's time grew with M although
the step's program did not. `opaque` hides such values behind PlaceholderWithDefault: an
identity on every device (its kernels and its XLA lowering are Identity's, so is its gradient)
that Grappler never folds, because it marks a value a caller could feed.
"""

import tensorflow as tf


def opaque(structure):
    """`structure` with every graph tensor leaf passed through an identity Grappler cannot fold
    (eager tensors, variables, None and composites are returned as they are)."""
    if tf.executing_eagerly():
        return structure

    def hide(t):
        if not isinstance(t, tf.Tensor):
            return t
        return tf.raw_ops.PlaceholderWithDefault(input=t, shape=t.shape)

    return tf.nest.map_structure(hide, structure)
