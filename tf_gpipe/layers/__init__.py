"""The layer library: every layer is a BaseLayer with Params(), FProp and FPropMeta."""

from tf_gpipe.layers.attention import MultiHeadAttention
from tf_gpipe.layers.conv import Conv2DLayer
from tf_gpipe.layers.dropout import DropoutLayer
from tf_gpipe.layers.embedding import EmbeddingLayer, PositionalEmbeddingLayer
from tf_gpipe.layers.fc import FCLayer
from tf_gpipe.layers.keras_layer import KerasLayer
from tf_gpipe.layers.normalization import BatchNormLayer, LayerNorm
from tf_gpipe.layers.pooling import GlobalPoolingLayer, PoolingLayer
from tf_gpipe.layers.sequential import RepeatLayer, SequentialLayer
from tf_gpipe.layers.softmax import SoftmaxLayer
from tf_gpipe.layers.transformer import TransformerLayer

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
