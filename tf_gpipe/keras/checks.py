"""Refusals at construction for what a chain of cells cannot carry: losses made inside a call.

A loss a layer makes in its call (`add_loss`, an activity regularizer) would be made inside a
cell, once per micro-batch and recompute, and could not reach fit() as the plain model's loss.
"""

import keras
import numpy as np

from tf_gpipe.keras import state as keras_state

_FIX = (
    'Return the quantity as a model output and give it a loss in compile(), or use a weight '
    'regularizer (kernel_regularizer=...).'
)


def check_supported(layers, input_specs=None):
    """Raises ValueError naming the first layer that makes a loss in its call.

    Keras's own layers make one only through an activity regularizer (read from the layer); a
    custom layer is run once, on one zero example, in a Keras StatelessScope that collects the
    losses it adds (and changes no variable). `input_specs`: each layer's (batch shape, dtype)
    (else the layer's own `input`, when it was called on one).
    """
    for i, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            continue  # a Keras op (x + y): no weights, no losses
        for sub in keras_state.sublayers(layer):
            if getattr(sub, 'activity_regularizer', None) is not None:
                raise ValueError(
                    f'Layer {sub.name!r} has an activity_regularizer, whose loss would be made '
                    f'inside a cell and cannot reach fit(). {_FIX}'
                )
        spec = input_specs[i] if input_specs is not None else None
        if _adds_losses(layer, spec):
            raise ValueError(
                f'Layer {layer.name!r} ({type(layer).__name__}) adds a loss in its call '
                '(add_loss): made inside a pipeline cell once per micro-batch, it cannot reach '
                f"fit() as the plain model's loss. {_FIX}"
            )


def _adds_losses(layer, spec):
    if type(layer).__module__.startswith('keras.') or not layer.built:
        return False  # Keras's layers add none; an unbuilt one is checked when it runs
    try:
        if spec is not None:
            inputs = [_zeros(spec[0], spec[1])]
        else:
            inputs = keras.tree.map_structure(lambda t: _zeros(t.shape, t.dtype), layer.input)
            inputs = inputs if isinstance(inputs, list) else [inputs]
    except (AttributeError, ValueError, TypeError):
        return False  # called at several places, or never: checked when it runs
    try:
        with keras.StatelessScope(collect_losses=True) as scope:
            layer(*inputs)
    except Exception:  # noqa: BLE001 - not runnable alone: the first call checks it
        return False
    return bool(scope.losses)


def _zeros(shape, dtype):
    return np.zeros([1] + [d or 1 for d in shape[1:]], dtype=keras.backend.standardize_dtype(dtype))
