"""2-D convolution, optionally followed by batch norm, then an activation."""

import math

import tensorflow as tf

from tf_gpipe import base_layer
from tf_gpipe.layers import activations, normalization

_PADDINGS = ('SAME', 'VALID')


def conv_output_size(size, window, stride, padding):
    """Spatial output size of a convolution or pooling window along one axis."""
    if size is None:
        return None
    if padding == 'SAME':
        return math.ceil(size / stride)
    return math.ceil((size - window + 1) / stride)


def check_padding(p):
    if p.padding not in _PADDINGS:
        raise ValueError(
            f'{p.cls.__name__} {p.name!r}: padding must be one of {_PADDINGS}, got {p.padding!r}.'
        )


class Conv2DLayer(base_layer.BaseLayer):
    """Conv2D on NHWC inputs: filter_shape = (h, w, in, out)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('filter_shape', (0, 0, 0, 0), 'Filter shape (height, width, in, out).')
        p.Define('filter_stride', (1, 1), 'Stride (height, width).')
        p.Define('padding', 'SAME', "'SAME' or 'VALID'.")
        p.Define('bias', True, 'Whether to add a bias (redundant with batch_norm).')
        p.Define('batch_norm', False, 'Batch norm between the convolution and the activation.')
        p.Define('activation', 'RELU', 'Activation name (see FCLayer).')
        p.Define('bn', normalization.BatchNormLayer.Params(), 'Batch norm template (dim is set).')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        if len(p.filter_shape) != 4 or min(p.filter_shape) <= 0:
            raise ValueError(
                f'Conv2DLayer {p.name!r}: filter_shape must be 4 positive ints '
                f'(height, width, in, out), got {p.filter_shape!r}.'
            )
        check_padding(p)
        activations.check(p.activation)
        self.CreateVariable('w', list(p.filter_shape))
        if p.bias:
            self.CreateVariable('b', [p.filter_shape[3]], init=base_layer.WeightInit.Constant(0.0))
        if p.batch_norm:
            self.CreateChild('bn', p.bn.Copy().Set(name='bn', dim=p.filter_shape[3]))

    def FProp(self, inputs):
        p = self.params
        if inputs.shape.rank != 4 or inputs.shape[-1] not in (None, p.filter_shape[2]):
            raise ValueError(
                f'{p.name}: expects NHWC input with {p.filter_shape[2]} channels, '
                f'got shape {inputs.shape}.'
            )
        x = tf.cast(inputs, self.fprop_dtype)
        y = tf.nn.conv2d(x, self.CastToFPropDtype(self.vars.w), [1, *p.filter_stride, 1], p.padding)
        if p.bias:
            y += self.CastToFPropDtype(self.vars.b)
        if p.batch_norm:
            y = self.bn.FProp(y)
        return activations.get(p.activation)(y)

    @classmethod
    def FPropMeta(cls, p, inputs):
        n, h, w, _ = base_layer.to_shape(inputs).as_list()
        fh, fw, cin, cout = p.filter_shape
        oh = conv_output_size(h, fh, p.filter_stride[0], p.padding)
        ow = conv_output_size(w, fw, p.filter_stride[1], p.padding)
        out = tf.TensorShape([n, oh, ow, cout])
        outputs = n * oh * ow * cout
        flops = outputs * (
            2 * fh * fw * cin + int(p.bias) + activations.flops_per_element(p.activation)
        )
        params = fh * fw * cin * cout + (cout if p.bias else 0)
        act_bytes = outputs * base_layer.dtype_bytes(p.fprop_dtype or p.dtype)
        if p.batch_norm:
            flops += 8 * outputs
            params += 2 * cout
            act_bytes *= 2
        return base_layer.Meta(flops, out, params, act_bytes)
