"""Fully connected layer."""

import tensorflow as tf

from tf_gpipe import base_layer
from tf_gpipe.layers import activations


class FCLayer(base_layer.BaseLayer):
    """y = activation(x @ w + b) over the last dimension of x."""

    _POSITION_WISE = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Size of the last input dimension.')
        p.Define('output_dim', 0, 'Size of the last output dimension.')
        p.Define('activation', 'RELU', 'NONE, RELU, RELU6, TANH, SIGMOID, GELU, SWISH.')
        p.Define('bias', True, 'Whether to add a bias.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        base_layer.check_positive(p, 'input_dim', 'output_dim')
        activations.check(p.activation)
        self.CreateVariable('w', [p.input_dim, p.output_dim])
        if p.bias:
            self.CreateVariable('b', [p.output_dim], init=base_layer.WeightInit.Constant(0.0))

    def FProp(self, inputs):
        p = self.params
        if inputs.shape.rank is not None and inputs.shape[-1] not in (None, p.input_dim):
            raise ValueError(
                f"{p.name}: input's last dimension is {inputs.shape[-1]}, but input_dim is "
                f'{p.input_dim} (input shape {inputs.shape}).'
            )
        x = tf.cast(inputs, self.fprop_dtype)
        y = tf.tensordot(x, self.CastToFPropDtype(self.vars.w), axes=1)
        if p.bias:
            y += self.CastToFPropDtype(self.vars.b)
        return activations.get(p.activation)(y)

    @classmethod
    def FPropMeta(cls, p, inputs):
        inputs = base_layer.to_shape(inputs)
        rows = base_layer.num_elements(inputs[:-1])
        out = inputs[:-1].concatenate([p.output_dim])
        flops = (
            rows
            * p.output_dim
            * (2 * p.input_dim + int(p.bias) + activations.flops_per_element(p.activation))
        )
        params = p.input_dim * p.output_dim + (p.output_dim if p.bias else 0)
        act_bytes = rows * p.output_dim * base_layer.dtype_bytes(p.fprop_dtype or p.dtype)
        return base_layer.Meta(flops, out, params, act_bytes)
