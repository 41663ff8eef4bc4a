"""Keras front door: GPipe(keras.Sequential, ...) -> a keras.Model trained with fit()."""

from tf_gpipe.keras.gpipe_model import GPipe, GPipeModel

__all__ = ['GPipe', 'GPipeModel']
