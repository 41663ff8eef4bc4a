"""KerasNodeLayer: one call of a Keras layer in a functional model, as a step of a sequence.

A functional keras.Model is a graph; in topological order its calls form a sequence in which
every step reads a NestedMap of the tensors still needed (`state`, keyed by tensor name) and
passes on the tensors some later step or the model's output reads (`keep`). So a residual
connection or a branch that rejoins later simply rides in the state across the cells between —
the pipeline cuts the sequence anywhere and never needs to know the graph.

A step may also be a Keras op (`x + y` in a functional model is an `Add` operation), take
constants (`Const`) and take tensors by keyword. Keras masks ride the same way: a tensor `tN` that carries a mask has it beside it in the state
as `tN_mask` (keras_masks), put back on the tensor before each call, so Keras's own masking
(Embedding(mask_zero=True), Masking, attention, pooling, merges) works as in the plain model.
"""

import keras
import tensorflow as tf

from tf_gpipe import base_layer, fprop_context
from tf_gpipe.keras import masks as keras_masks
from tf_gpipe.keras import state as keras_state
from tf_gpipe.keras.layer import (
    KerasLayer,
    _python_random_seeded,
    _resolve,
    _size,
    check_no_call_losses,
    make_layer,
)
from tf_gpipe.nested_map import NestedMap


def map_leaves(structure, fn):
    """`structure` (nested lists) with fn applied to every leaf (anything but a list)."""
    if isinstance(structure, list):
        return [map_leaves(s, fn) for s in structure]
    return fn(structure)


def flat_leaves(structure):
    """The leaves of `structure`, in the order map_leaves visits them."""
    if isinstance(structure, list):
        return [leaf for s in structure for leaf in flat_leaves(s)]
    return [structure]


class Const:
    """A non-tensor argument of a call (the 2.0 of `x * 2.0`), passed as it is."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Const) and other.value == self.value

    def __repr__(self):
        return f'Const({self.value!r})'


def tensor_keys(args, kwargs=None):
    """The tensor keys of a call's args and kwargs (sorted by name), in one fixed order."""
    kwargs = kwargs or {}
    leaves = flat_leaves(list(args) + [kwargs[k] for k in sorted(kwargs)])
    return [leaf for leaf in leaves if not isinstance(leaf, Const)]


def _fill(structure, fn):
    return map_leaves(structure, lambda leaf: leaf.value if isinstance(leaf, Const) else fn(leaf))


class KerasNodeLayer(KerasLayer):
    """Calls its Keras layer (or op) on the state's tensors and returns the state to keep.

    The first step of a model takes the model inputs (`from_inputs` names them); the last one
    returns the model outputs (`to_outputs`) instead of a state.
    """

    _ACCEPTS_OPERATIONS = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('args', [], 'Positional arguments: nested lists of tensor keys and Consts.')
        p.Define('call_kwargs', {}, 'Keyword arguments: name -> nested keys and Consts.')
        p.Define('arg_dtypes', {}, 'The dtype of each tensor key of args and call_kwargs.')
        p.Define('outputs', [], "Keys of the layer's outputs, flattened.")
        p.Define('keep', [], 'Keys passed on to the next step (inputs or outputs of this one).')
        p.Define('from_inputs', [], 'First step: the keys of the model inputs, in order.')
        p.Define('to_outputs', [], 'Last step: the keys of the model outputs, in order.')
        return p

    def _Build(self, shape, dtype=None):
        del shape, dtype  # a node builds from its args' shapes
        p = self.params
        self._generators, self._batch_norms = [], []
        if not isinstance(self._layer, keras.layers.Layer):
            return  # a Keras op: nothing to build
        keys = tensor_keys(p.args, p.call_kwargs)
        shapes = dict(zip(keys, (tuple(s) for s in p.input_shape)))
        if len(keys) == 1 and list(p.args) == keys and not p.call_kwargs:
            return super()._Build(shapes[keys[0]], p.arg_dtypes[keys[0]])
        # Several arguments (attention's query and value), a list (Add, Concatenate), tensors
        # by keyword or constants: run it once on one zero example of every tensor.
        zeros = {k: tf.zeros((1,) + shapes[k][1:], tf.as_dtype(p.arg_dtypes[k])) for k in keys}
        args, kwargs = self._Arguments(zeros.__getitem__)
        with _python_random_seeded(self._seed_for_build), tf.init_scope():
            self._layer(*args, **kwargs)
        self._AdoptBuilt()

    def _Arguments(self, value_of):
        p = self.params
        args = _fill(list(p.args), value_of)
        kwargs = {k: _fill(v, value_of) for k, v in p.call_kwargs.items()}
        return args, kwargs

    def FProp(self, *inputs):
        p = self.params
        if p.from_inputs and len(p.from_inputs) != len(inputs):
            raise ValueError(
                f'{p.name}: the model takes {len(p.from_inputs)} inputs, got {len(inputs)}.'
            )
        state = NestedMap(zip(p.from_inputs, inputs)) if p.from_inputs else inputs[0]
        masked = {}  # key -> the copy of its tensor that carries its mask into the call

        def value_of(k):
            if keras_masks.key(k) not in state:
                return state[k]
            masked[k] = keras_masks.attach(state[k], state[keras_masks.key(k)])
            return masked[k]

        args, kwargs = self._Arguments(value_of)
        if self._takes_training:
            kwargs['training'] = fprop_context.current().training
        keras_state.replay_seeds(self._generators)
        out = self._layer(*args, **kwargs)
        check_no_call_losses(self._layer)
        produced = _with_masks(p.outputs, tf.nest.flatten(out))
        # A layer may take the mask off its input tensor (MultiHeadAttention does): in the plain
        # model later readers of that tensor then see no mask, so here they see none either.
        stripped = {k for k, t in masked.items() if keras_masks.read(t) is None}
        gone = {keras_masks.key(k) for k in stripped}
        state = NestedMap({k: v for k, v in state.items() if k not in gone})
        return _Pass(p, state, produced)

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        shapes = NestedMap(zip(p.from_inputs, input_shapes)) if p.from_inputs else input_shapes[0]

        def spec(k):
            shape = tuple(base_layer.to_shape(shapes[k]).as_list())
            tensor = keras.KerasTensor(shape, dtype=p.arg_dtypes[k])
            if keras_masks.key(k) not in shapes:
                return tensor
            mask = base_layer.to_shape(shapes[keras_masks.key(k)]).as_list()
            return keras_masks.attach(tensor, keras.KerasTensor(tuple(mask), dtype='bool'))

        with keras.StatelessScope():  # builds without allocating the weights
            layer = make_layer(_resolve(p.keras_layer, p.name, True), p.config)
            args = _fill(list(p.args), spec)
            kwargs = {k: _fill(v, spec) for k, v in p.call_kwargs.items()}
            out = layer(*args, **kwargs)
            weights = getattr(layer, 'trainable_weights', [])  # an op has none
            params = sum(_size(w.shape) for w in weights)
            produced = _with_masks(p.outputs, tf.nest.flatten(out))
        produced = {k: tf.TensorShape(t.shape) for k, t in produced.items()}
        flat = [produced[k] for k in p.outputs if k in produced]
        out_elems = sum(base_layer.num_elements(s) for s in flat)
        positions = 1
        if flat and flat[0].rank:
            positions = max(base_layer.num_elements(flat[0]) // max(int(flat[0][-1] or 1), 1), 1)
        act_bytes = out_elems * base_layer.dtype_bytes(p.fprop_dtype or p.dtype)
        return base_layer.Meta(
            2 * params * positions + out_elems, _Pass(p, shapes, produced), params, act_bytes
        )


def _with_masks(keys, tensors):
    """{key: tensor} for a call's outputs, with `key_mask` for each one that carries a mask."""
    produced = {}
    for key, tensor in zip(keys, tensors):
        produced[key] = tensor
        mask = keras_masks.read(tensor)
        if mask is not None:
            produced[keras_masks.key(key)] = mask
    return produced


def _Pass(p, state, produced):
    """What a step passes on: the kept keys (and their masks) as a NestedMap, or for the last
    step the model outputs (an output that carries a mask as NestedMap(value=, mask=))."""
    every = {**state, **produced}
    if p.to_outputs:
        outs = tuple(
            NestedMap(value=every[k], mask=every[keras_masks.key(k)])
            if keras_masks.key(k) in every
            else every[k]
            for k in p.to_outputs
        )
        return outs[0] if len(outs) == 1 else outs
    kept = NestedMap()
    for k in p.keep:
        kept[k] = every[k]
        if keras_masks.key(k) in every:
            kept[keras_masks.key(k)] = every[keras_masks.key(k)]
    return kept
