"""The tf.Variable behind a variable a user hands us: itself, or a Keras 3 variable's."""

import tensorflow as tf


def backing(variable):
    """The tf.Variable behind a Keras variable (`KerasVariable.value`, listed in
    docs/private-apis.md): the one the pipeline's tapes see and TF's kernels update. A
    tf.Variable, or anything without a `value`, is returned as given."""
    if isinstance(variable, tf.Variable):
        return variable
    return getattr(variable, 'value', variable)
