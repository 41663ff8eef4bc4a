"""Spatial pooling (max / average windows) and global pooling on NHWC inputs."""

import tensorflow as tf

from tf_gpipe import base_layer
from tf_gpipe.layers import conv

_TYPES = ('MAX', 'AVG')


def _check_type(p):
    if p.pooling_type not in _TYPES:
        raise ValueError(
            f'{p.cls.__name__} {p.name!r}: pooling_type must be one of {_TYPES}, '
            f'got {p.pooling_type!r}.'
        )


def max_pool(x, window, stride, padding):
    """2-D max pooling whose backward recomputes the pooling beside its gradient.

    oneDNN's fast MaxPoolGrad on CPU reads a workspace its forward MaxPool left in the same
    graph; a backward in a function of its own (a kept micro-batch's, which TF derives from the
    forward's call or the tick loop cuts from one trace) would otherwise get Eigen's kernel,
    some 50x slower (AmoebaNet-D's step 1.6x the plain one's, docs/results.md). Recomputing
    one pooling costs a few percent of its gradient; the values are the same.
    """
    attrs = dict(ksize=[1, *window, 1], strides=[1, *stride, 1], padding=padding)

    @tf.custom_gradient
    def pool(x):
        def grad(dy):
            y = tf.raw_ops.MaxPool(input=x, **attrs)  # again, beside its gradient
            return tf.raw_ops.MaxPoolGrad(orig_input=x, orig_output=y, grad=dy, **attrs)

        return tf.raw_ops.MaxPool(input=x, **attrs), grad

    return pool(x)


class PoolingLayer(base_layer.BaseLayer):
    """Max or average pooling over (height, width) windows."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('pooling_type', 'MAX', "'MAX' or 'AVG'.")
        p.Define('window_shape', (2, 2), 'Window (height, width).')
        p.Define('window_stride', (2, 2), 'Stride (height, width).')
        p.Define('padding', 'SAME', "'SAME' or 'VALID'.")
        return p

    def __init__(self, params):
        super().__init__(params)
        _check_type(self.params)
        conv.check_padding(self.params)

    def FProp(self, inputs):
        p = self.params
        x = tf.cast(inputs, self.fprop_dtype)
        if p.pooling_type == 'MAX':
            return max_pool(x, p.window_shape, p.window_stride, p.padding)
        return tf.nn.pool(x, p.window_shape, 'AVG', strides=p.window_stride, padding=p.padding)

    @classmethod
    def FPropMeta(cls, p, inputs):
        n, h, w, c = base_layer.to_shape(inputs).as_list()
        oh = conv.conv_output_size(h, p.window_shape[0], p.window_stride[0], p.padding)
        ow = conv.conv_output_size(w, p.window_shape[1], p.window_stride[1], p.padding)
        outputs = n * oh * ow * c
        flops = outputs * p.window_shape[0] * p.window_shape[1]
        act_bytes = outputs * base_layer.dtype_bytes(p.fprop_dtype or p.dtype)
        return base_layer.Meta(flops, tf.TensorShape([n, oh, ow, c]), 0, act_bytes)


class GlobalPoolingLayer(base_layer.BaseLayer):
    """Max or average over height and width: [N, H, W, C] -> [N, C]."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('pooling_type', 'AVG', "'MAX' or 'AVG'.")
        return p

    def __init__(self, params):
        super().__init__(params)
        _check_type(self.params)

    def FProp(self, inputs):
        x = tf.cast(inputs, self.fprop_dtype)
        reduce = tf.reduce_max if self.params.pooling_type == 'MAX' else tf.reduce_mean
        return reduce(x, axis=[1, 2])

    @classmethod
    def FPropMeta(cls, p, inputs):
        n, h, w, c = base_layer.to_shape(inputs).as_list()
        act_bytes = n * c * base_layer.dtype_bytes(p.fprop_dtype or p.dtype)
        return base_layer.Meta(n * h * w * c, tf.TensorShape([n, c]), 0, act_bytes)
