"""The original Keras layers' state in their clones, and a check that each clone is its original.

GPipe builds every layer again on its cell's device from `get_config()`. Two things can make
that copy a different layer: state that is not a weight (an adapted Normalization's mean, a
Dropout's seed), and a `get_config()` that omits a constructor argument (harmless in plain Keras
until the model is saved). The first is copied here as Keras's own saving does (each layer's
`save_own_variables` / `load_own_variables`, which finalise derived state); the second is found
by comparing the two layers' plain attributes, and refused with the layer's name.
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from tf_gpipe.keras import layer as keras_layer
from tf_gpipe.keras import state as keras_state
from tf_gpipe.runtime import placement

_PLAIN = (bool, int, float, str, type(None), np.generic)
_MISSING = object()


def copy_state(original, clone):
    """Copies `original`'s variables (and its layers') into `clone`, as Keras's saving does,
    and the seeds of its random layers (so a set_random_seed'ed model draws the same masks
    however often it is pipelined)."""
    pairs = _pairs(original, clone)
    with tf.device(placement.device_of(clone.weights[0]) if clone.weights else None):
        for source, target in pairs:
            store = {}
            source.save_own_variables(store)
            target.load_own_variables(store)
    for source, target in zip(
        keras_state.seed_generators(original), keras_state.seed_generators(clone)
    ):
        seed = np.asarray(source.state.numpy())[0]
        state = np.asarray(target.state.numpy()).copy()
        state[0] = seed
        target.state.assign(state)


def check_clone(original, clone):
    """Raises ValueError naming the layer if `clone` (from get_config) is not `original`."""
    for source, target in _pairs(original, clone):
        for name, fresh in _constructor_attributes(source).items():
            want, got = getattr(source, name, _MISSING), getattr(target, name, _MISSING)
            if want is _MISSING or not _plain(want) or not _same(got, fresh):
                continue  # set by build() (the original may be built on another shape)
            if not _same(got, want):
                raise ValueError(
                    f'Layer {source.name!r} ({type(source).__name__}) rebuilt from its '
                    f'get_config() is not the original: its attribute {name!r} is {want!r}, in '
                    f'the rebuilt layer {got!r}. GPipe builds each layer again on its device from '
                    'get_config(); make get_config() return every constructor argument (as '
                    'Keras needs for saving too).'
                )


def _pairs(original, clone):
    sources, targets = keras_state.sublayers(original), keras_state.sublayers(clone)
    if len(sources) != len(targets):
        raise ValueError(
            f'Layer {original.name!r} ({type(original).__name__}) rebuilt from its get_config() '
            f'has {len(targets)} layers inside, the original {len(sources)}. GPipe builds each '
            'layer again on its device from get_config(); make get_config() return every '
            'constructor argument.'
        )
    return list(zip(sources, targets))


@functools.cache
def _framework_attributes():
    """The attribute names every Keras layer has (the framework's, not a layer's settings)."""
    return frozenset(vars(keras.layers.Layer()))


def _constructor_attributes(layer):
    """{name: value} of the plain attributes the constructor sets from `layer`'s config, beyond
    every Keras layer's own. The clone is compared on those its build() left alone: build may
    set others from the input shape (the original may have been built on another, by adapt)."""
    with keras.StatelessScope():
        fresh = keras_layer.make_layer(type(layer), keras_layer.layer_config(layer))
    base = _framework_attributes()
    return {k: v for k, v in vars(fresh).items() if k not in base and _plain(v)}


def _plain(value):
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _same(a, b):
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return True
    return bool(a == b)
