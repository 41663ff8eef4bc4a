"""Keras masks read from and attached to tensors through Keras's public masking protocol.

A Keras mask rides on its tensor as an attribute, so it is lost when the tensor crosses a cell
(a micro-batch split, a device copy, a function boundary). The pipeline carries each mask as a
tensor of its own and puts it back on its tensor before the next layer call. Both directions use
only what Keras documents for custom layers: a layer whose `call` takes `mask` receives the mask
of its input, and a layer's `compute_mask` sets the mask of its output.
"""

import keras


class _AttachMask(keras.layers.Layer):
    """Returns a copy of x that carries `mask` (Keras sets it from compute_mask)."""

    def __init__(self):
        super().__init__(name=type(self).__name__.strip('_'), dtype='float32', autocast=False)

    def call(self, x, mask=None):
        del mask
        return keras.ops.copy(x)

    def compute_mask(self, x, mask=None):
        return mask

    def compute_output_spec(self, x, mask=None):
        return keras.KerasTensor(x.shape, dtype=x.dtype)


class _ReadMask(keras.layers.Layer):
    """Records the mask Keras hands to `call` (the mask its input carries)."""

    def __init__(self):
        super().__init__(name=type(self).__name__.strip('_'), dtype='float32', autocast=False)
        self.supports_masking = True
        self.seen = None

    def call(self, x, mask=None):
        self.seen = mask
        return x

    def compute_output_spec(self, x, mask=None):
        self.seen = mask
        return keras.KerasTensor(x.shape, dtype=x.dtype)


def attach(x, mask):
    """A tensor equal to x that carries `mask` as its Keras mask (x itself if mask is None)."""
    return x if mask is None else _AttachMask()(x, mask=mask)


def read(x):
    """The Keras mask x carries, or None (x a tensor or a KerasTensor)."""
    reader = _ReadMask()
    reader(x)
    return reader.seen


def key(tensor_key):
    """The state key that carries the mask of `tensor_key`."""
    return f'{tensor_key}_mask'
