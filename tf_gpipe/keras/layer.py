"""KerasLayer: any keras.layers.Layer (class + config) as a BaseLayer in our sequences."""

import contextlib
import inspect
import random

import keras
import tensorflow as tf

from tf_gpipe import base_layer, fprop_context
from tf_gpipe.keras import state as keras_state


def _resolve(keras_layer, name, operations=False):
    """The Keras layer class (or, with `operations`, also a keras.Operation class: `x + y`)."""
    base = keras.Operation if operations else keras.layers.Layer
    if isinstance(keras_layer, type) and issubclass(keras_layer, base):
        return keras_layer
    if isinstance(keras_layer, str) and isinstance(getattr(keras.layers, keras_layer, None), type):
        return getattr(keras.layers, keras_layer)
    raise ValueError(
        f'KerasLayer {name!r}: keras_layer must be a keras.layers.Layer subclass '
        f'or the name of one in keras.layers (e.g. "Dense"), got {keras_layer!r}.'
    )


def layer_config(layer):
    """`layer.get_config()`, with a Lambda's Python functions as themselves: Keras serializes
    them as bytecode, which it refuses to load back in safe mode (rightly, from disk); a copy
    made in this process needs no deserializing."""
    config = layer.get_config()
    if isinstance(layer, keras.layers.Lambda):
        config['function'] = layer.function
        if isinstance(config.get('output_shape'), dict):  # a function too
            config['output_shape'] = layer.compute_output_shape
        if isinstance(config.get('mask'), dict):
            config['mask'] = layer.mask
    return config


def make_layer(cls, config):
    """`cls` from a config of `layer_config` (Python functions in it go to the constructor)."""
    config = dict(config)
    if any(callable(v) and not isinstance(v, type) for v in config.values()):
        return cls(**config)
    return cls.from_config(config)


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
    `training` from `fprop_context`. Inside a pipeline its random draws (Dropout masks) depend
    on (step, micro-batch), so a recompute replays them; its BatchNormalization layers normalise
    per call and move their averages in `PostTrainingStepUpdate`, once per step, with the
    statistics of everything seen in the step (see keras_state).
    """

    _ACCEPTS_OPERATIONS = False

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('keras_layer', None, 'A keras.layers.Layer subclass or its name ("Dense").')
        p.Define('config', {}, 'Keyword arguments of the Keras layer constructor.')
        p.Define('input_shape', None, 'Input shape with batch (None allowed) to build now.')
        p.Define(
            'input_dtype', None, 'Input dtype, for a layer built by running it (None: fprop_dtype).'
        )
        p.Define(
            'autocast', True, 'Cast float inputs to fprop_dtype (off: the Keras dtype policy does).'
        )
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        cls = _resolve(p.keras_layer, p.name, self._ACCEPTS_OPERATIONS)
        seed = base_layer.variable_seed(self._base_seed, self.seed_name)[0]
        self._seed_for_build = seed
        with _python_random_seeded(seed):
            self._layer = make_layer(cls, p.config)
        self._takes_training = 'training' in inspect.signature(self._layer.call).parameters
        self._generators, self._batch_norms = [], []
        if p.input_shape is not None:
            self._Build(tuple(p.input_shape))

    def _Build(self, shape, dtype=None):
        with _python_random_seeded(self._seed_for_build), tf.init_scope():
            if _builds_by_running(self._layer):
                # No build() of its own (plain Keras allows that): its sublayers get their
                # weights only when call() runs, so run it once on one zero example.
                self._layer(*_zeros(shape, dtype or self.params.input_dtype or self.fprop_dtype))
            else:
                self._layer.build(shape)
        self._AdoptBuilt()

    def _AdoptBuilt(self):
        """Once the Keras layer is built: its variables, and keras_state's take-over of its
        random layers, batch norms and max poolings."""
        self._RegisterVariables()
        self._generators = keras_state.seed_generators(self._layer)
        self._batch_norms = keras_state.batch_norm_stats(self._layer)
        keras_state.recomputing_max_pools(self._layer)

    def ReplayedState(self):
        # The seed generators' counters, set from (step, micro-batch) before each call.
        return [gen.state.value for gen in self._generators]

    @property
    def keras_layer(self):
        return self._layer

    def ShareFrom(self, other):
        """Runs `other`'s Keras layer (its weights) instead of its own: a Keras layer used at
        several places of a model stays one set of weights, wherever its uses land; each use's
        gradient reaches it (the pipeline sums every reader's contribution)."""
        self._layer = other._layer
        self._takes_training = other._takes_training
        self._generators, self._batch_norms = other._generators, []  # moved once, by `other`
        self._vars = dict(other._vars)

    def _RegisterVariables(self):
        # Every distinct variable once, under a unique name: inside a nested model (a Keras
        # application in a Sequential) many paths end in 'kernel' / 'bias', and a sublayer used
        # twice lists its weights twice (one variable, one entry).
        known = {v.ref() for v in self._vars.values()}
        for v in self._layer.weights:
            if v.value.ref() in known:
                continue
            known.add(v.value.ref())
            base = v.path.split('/', 1)[-1].replace('/', '__') if '/' in v.path else v.name
            base = name = base_layer.module_name(base)
            i = 1
            while name in self._vars:
                name, i = f'{base}_{i}', i + 1
            self._vars[name] = v.value

    def FProp(self, *inputs):
        if self.params.autocast:
            inputs = [tf.cast(x, self.fprop_dtype) if x.dtype.is_floating else x for x in inputs]
        if not self._layer.built:
            shapes = [tuple(x.shape) for x in inputs]
            self._Build(shapes[0] if len(shapes) == 1 else shapes, inputs[0].dtype)
        kwargs = {'training': fprop_context.current().training} if self._takes_training else {}
        keras_state.replay_seeds(self._generators)
        out = self._layer(*inputs, **kwargs)
        check_no_call_losses(self._layer)
        return out

    def PostTrainingStepUpdate(self):
        for stats in self._batch_norms:
            stats.apply()
        super().PostTrainingStepUpdate()

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        shapes = [tuple(base_layer.to_shape(s).as_list()) for s in input_shapes]
        arg = shapes[0] if len(shapes) == 1 else shapes
        with keras.StatelessScope():  # Builds without allocating the weights.
            layer = make_layer(_resolve(p.keras_layer, p.name), p.config)
            if _builds_by_running(layer):  # a symbolic call builds its sublayers
                dtype = p.input_dtype or p.fprop_dtype or p.dtype
                specs = [keras.KerasTensor(s, dtype=dtype) for s in shapes]
                out = tf.TensorShape(layer(*specs).shape)
            else:
                layer.build(arg)
                out = tf.TensorShape(layer.compute_output_shape(arg))
            params = sum(_size(w.shape) for w in layer.trainable_weights)
        out_elems = base_layer.num_elements(out)
        positions = out_elems // max(int(out[-1] or 1), 1)
        act_bytes = out_elems * base_layer.dtype_bytes(p.fprop_dtype or p.dtype)
        # Estimate: each weight is used once per output position (exact for Dense).
        return base_layer.Meta(2 * params * positions + out_elems, out, params, act_bytes)


def check_no_call_losses(layer):
    """Refuses a loss made by `add_loss` inside a call: made in a cell, once per micro-batch
    and recompute, it could not be the plain model's loss (weight regularizers are fine)."""
    if not isinstance(layer, keras.layers.Layer):
        return
    regularized = sum(1 for v in layer.trainable_weights if v.regularizer is not None)
    if len(layer.losses) > regularized:
        raise ValueError(
            f'Layer {layer.name!r} adds a loss in its call (add_loss), which would be made '
            'inside a pipeline cell once per micro-batch and cannot reach fit() as the plain '
            "model's loss. Return the quantity as a model output and give it a loss in "
            'compile(), or use a weight regularizer (kernel_regularizer=...).'
        )


def _builds_by_running(layer):
    """A layer without a build() of its own (Keras builds it by running call())."""
    return type(layer).build is keras.layers.Layer.build


def _zeros(shape, dtype):
    """One zero example (batch 1) per input of `shape` (one shape, or a list of them)."""
    shapes = [shape] if not shape or not isinstance(shape[0], (list, tuple)) else shape
    return [tf.zeros((1,) + tuple(s[1:]), tf.as_dtype(dtype)) for s in shapes]


def _size(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n
