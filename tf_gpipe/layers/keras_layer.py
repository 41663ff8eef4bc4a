"""KerasLayer: any keras.layers.Layer (class + config) as a BaseLayer in our sequences."""

import contextlib
import inspect
import random

import keras
import tensorflow as tf

from tf_gpipe import base_layer, fprop_context


def _resolve(keras_layer, name):
    if isinstance(keras_layer, type) and issubclass(keras_layer, keras.layers.Layer):
        return keras_layer
    if isinstance(keras_layer, str) and isinstance(getattr(keras.layers, keras_layer, None), type):
        return getattr(keras.layers, keras_layer)
    raise ValueError(
        f'KerasLayer {name!r}: keras_layer must be a keras.layers.Layer subclass '
        f'or the name of one in keras.layers (e.g. "Dense"), got {keras_layer!r}.'
    )


@contextlib.contextmanager
def _python_random_seeded(seed):
    """Keras draws default initialiser seeds from Python's `random`; pin it, then restore."""
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


class KerasLayer(base_layer.BaseLayer):
    """Wraps `keras_layer(**config)`; its variables become this layer's variables.

    With `input_shape` set the Keras layer is built (variables created) at Instantiate();
    otherwise on the first FProp, as in Keras. With `random_seed` set, the initial weights
    depend only on (random_seed, layer name path), like our own layers'. The Keras layer gets
    `training` from `fprop_context`; Keras' own random layers (keras.layers.Dropout) draw new
    masks on every call — use our DropoutLayer where a pipeline must replay masks.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('keras_layer', None, 'A keras.layers.Layer subclass or its name ("Dense").')
        p.Define('config', {}, 'Keyword arguments of the Keras layer constructor.')
        p.Define('input_shape', None, 'Input shape with batch (None allowed) to build now.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        cls = _resolve(p.keras_layer, p.name)
        seed = base_layer.variable_seed(self._base_seed, self.seed_name)[0]
        self._seed_for_build = seed
        with _python_random_seeded(seed):
            self._layer = cls(**dict(p.config))
        self._takes_training = 'training' in inspect.signature(self._layer.call).parameters
        if p.input_shape is not None:
            with _python_random_seeded(seed), tf.init_scope():
                self._layer.build(tuple(p.input_shape))
            self._RegisterVariables()

    @property
    def keras_layer(self):
        return self._layer

    def _RegisterVariables(self):
        for v in self._layer.weights:
            name = v.path.split('/', 1)[-1].replace('/', '__') if '/' in v.path else v.name
            name = base_layer._module_name(name)
            if name not in self._vars:
                self._vars[name] = v.value

    def FProp(self, *inputs):
        inputs = [tf.cast(x, self.fprop_dtype) if x.dtype.is_floating else x for x in inputs]
        kwargs = {'training': fprop_context.current().training} if self._takes_training else {}
        if not self._layer.built:
            with _python_random_seeded(self._seed_for_build):
                out = self._layer(*inputs, **kwargs)
            self._RegisterVariables()
            return out
        return self._layer(*inputs, **kwargs)

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        shapes = [tuple(base_layer.to_shape(s).as_list()) for s in input_shapes]
        arg = shapes[0] if len(shapes) == 1 else shapes
        with keras.StatelessScope():  # Builds without allocating the weights.
            layer = _resolve(p.keras_layer, p.name)(**dict(p.config))
            layer.build(arg)
            out = tf.TensorShape(layer.compute_output_shape(arg))
            params = sum(_size(w.shape) for w in layer.trainable_weights)
        out_elems = base_layer.num_elements(out)
        positions = out_elems // max(int(out[-1] or 1), 1)
        act_bytes = out_elems * base_layer.dtype_bytes(p.fprop_dtype or p.dtype)
        # Estimate: each weight is used once per output position (exact for Dense).
        return base_layer.Meta(2 * params * positions + out_elems, out, params, act_bytes)


def _size(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n
