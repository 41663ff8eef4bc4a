"""The layer library: every layer is a BaseLayer with Params(), FProp and FPropMeta."""

from tf_gpipe.layers.attention import MultiHeadAttention
from tf_gpipe.layers.conv import Conv2DLayer
from tf_gpipe.layers.dropout import DropoutLayer
from tf_gpipe.layers.embedding import EmbeddingLayer, PositionalEmbeddingLayer
from tf_gpipe.layers.fc import FCLayer
from tf_gpipe.layers.normalization import BatchNormLayer, LayerNorm
from tf_gpipe.layers.pooling import GlobalPoolingLayer, PoolingLayer
from tf_gpipe.layers.softmax import SoftmaxLayer
from tf_gpipe.layers.transformer import TransformerLayer
from tf_gpipe.sequential import RepeatLayer, SequentialLayer

__all__ = [
    'BatchNormLayer',
    'Conv2DLayer',
    'DropoutLayer',
    'EmbeddingLayer',
    'FCLayer',
    'GlobalPoolingLayer',
    'KerasLayer',
    'LayerNorm',
    'MultiHeadAttention',
    'PoolingLayer',
    'PositionalEmbeddingLayer',
    'RepeatLayer',
    'SequentialLayer',
    'SoftmaxLayer',
    'TransformerLayer',
]


def __getattr__(name):
    # KerasLayer lives with the other Keras adapters in tf_gpipe.keras, which imports the engine
    # (and the engine these layers): it is imported when first named, not with this package.
    if name == 'KerasLayer':
        from tf_gpipe.keras.layer import KerasLayer

        return KerasLayer
    raise AttributeError(f"module 'tf_gpipe.layers' has no attribute {name!r}")
