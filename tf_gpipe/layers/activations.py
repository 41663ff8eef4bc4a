"""Activation functions by name, as layer params spell them ('RELU', 'GELU', ...)."""

import difflib

import tensorflow as tf

_ACTIVATIONS = {
    'NONE': tf.identity,
    'RELU': tf.nn.relu,
    'RELU6': tf.nn.relu6,
    'TANH': tf.tanh,
    'SIGMOID': tf.sigmoid,
    'GELU': lambda x: tf.nn.gelu(x, approximate=False),
    'GELU_APPROX': lambda x: tf.nn.gelu(x, approximate=True),
    'SWISH': tf.nn.silu,
}

# Rough flops per element, for FPropMeta.
_FLOPS = {
    'NONE': 0,
    'RELU': 1,
    'RELU6': 2,
    'TANH': 8,
    'SIGMOID': 4,
    'GELU': 10,
    'GELU_APPROX': 10,
    'SWISH': 5,
}


def check(name):
    """Raises a ValueError naming the closest activation when `name` is unknown."""
    if name not in _ACTIVATIONS:
        close = difflib.get_close_matches(str(name).upper(), list(_ACTIVATIONS), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ''
        raise ValueError(f'Unknown activation {name!r}; {hint}valid: {", ".join(_ACTIVATIONS)}.')
    return name


def get(name):
    """The activation function called `name`."""
    return _ACTIVATIONS[check(name)]


def flops_per_element(name):
    return _FLOPS[check(name)]
