"""tf_gpipe: GPipe pipeline parallelism for TensorFlow 2, in the style of Lingvo."""

__version__ = '0.1.0'
