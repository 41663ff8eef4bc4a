"""Keras front door: GPipe(Sequential or functional model, ...) -> a keras.Model for fit()."""

from tf_gpipe.keras.gpipe_model import GPipe, GPipeModel

__all__ = ['GPipe', 'GPipeModel']
