"""KerasNodeLayer: one call of a Keras layer in a functional model, as a step of a sequence.

A functional keras.Model is a graph; in topological order its calls form a sequence in which
every step reads a NestedMap of the tensors still needed (`state`, keyed by tensor name) and
passes on the tensors some later step or the model's output reads (`keep`). So a residual
connection or a branch that rejoins later simply rides in the state across the cells between —
the pipeline cuts the sequence anywhere and never needs to know the graph.
"""

import keras
import tensorflow as tf

from tf_gpipe import base_layer, fprop_context
from tf_gpipe.layers import keras_state
from tf_gpipe.layers.keras_layer import KerasLayer, _python_random_seeded, _resolve, _size
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


class KerasNodeLayer(KerasLayer):
    """Calls its Keras layer on the state's tensors `args` and returns the state to keep.

    The first step of a model takes the model inputs (`from_inputs` names them); the last one
    returns the model outputs (`to_outputs`) instead of a state.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('args', [], 'Positional arguments: nested lists of tensor keys.')
        p.Define('arg_dtypes', [], 'The dtype of each key of args, in the same structure.')
        p.Define('outputs', [], "Keys of the layer's outputs, flattened.")
        p.Define('call_kwargs', {}, 'Non-tensor keyword arguments of the call.')
        p.Define('keep', [], 'Keys passed on to the next step (inputs or outputs of this one).')
        p.Define('from_inputs', [], 'First step: the keys of the model inputs, in order.')
        p.Define('to_outputs', [], 'Last step: the keys of the model outputs, in order.')
        return p

    def _Build(self, shape, dtype=None):
        del shape, dtype  # a node builds from its args' shapes
        p = self.params
        # input_shape holds one shape per key of args, in order: nest them like args.
        flat_shapes = iter(p.input_shape)
        shapes = map_leaves(list(p.args), lambda _: tuple(next(flat_shapes)))
        if len(p.args) == 1 and not isinstance(shapes[0], list):
            return super()._Build(shapes[0], p.arg_dtypes[0])
        # Several arguments (attention's query and value) or a list (Add, Concatenate): run it
        # once on one zero example of every argument.
        dtypes = iter(flat_leaves(list(p.arg_dtypes)))
        zeros = map_leaves(shapes, lambda s: tf.zeros((1,) + s[1:], tf.as_dtype(next(dtypes))))
        with _python_random_seeded(self._seed_for_build), tf.init_scope():
            self._layer(*zeros, **dict(p.call_kwargs))
        self._RegisterVariables()
        self._generators = keras_state.seed_generators(self._layer)
        self._batch_norms = keras_state.batch_norm_stats(self._layer)

    def FProp(self, *inputs):
        p = self.params
        if p.from_inputs and len(p.from_inputs) != len(inputs):
            raise ValueError(
                f'{p.name}: the model takes {len(p.from_inputs)} inputs, got {len(inputs)}.'
            )
        state = NestedMap(zip(p.from_inputs, inputs)) if p.from_inputs else inputs[0]
        args = map_leaves(list(p.args), state.__getitem__)
        kwargs = dict(p.call_kwargs)
        if self._takes_training:
            kwargs['training'] = fprop_context.current().training
        keras_state.replay_seeds(self._generators)
        out = self._layer(*args, **kwargs)
        produced = dict(zip(p.outputs, tf.nest.flatten(out)))
        if p.to_outputs:
            every = {**state, **produced}
            outs = tuple(every[k] for k in p.to_outputs)
            return outs[0] if len(outs) == 1 else outs
        return NestedMap({k: produced[k] if k in produced else state[k] for k in p.keep})

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        shapes = NestedMap(zip(p.from_inputs, input_shapes)) if p.from_inputs else input_shapes[0]
        dtypes = dict(zip(flat_leaves(list(p.args)), flat_leaves(list(p.arg_dtypes))))
        specs = map_leaves(
            list(p.args),
            lambda k: keras.KerasTensor(
                tuple(base_layer.to_shape(shapes[k]).as_list()), dtype=dtypes[k]
            ),
        )
        with keras.StatelessScope():  # builds without allocating the weights
            layer = _resolve(p.keras_layer, p.name).from_config(dict(p.config))
            out = layer(*specs, **dict(p.call_kwargs))
            params = sum(_size(w.shape) for w in layer.trainable_weights)
        flat = [tf.TensorShape(t.shape) for t in tf.nest.flatten(out)]
        produced = dict(zip(p.outputs, flat))
        out_elems = sum(base_layer.num_elements(s) for s in flat)
        positions = max(
            base_layer.num_elements(flat[0]) // max(int(flat[0][-1] or 1), 1) if flat else 1, 1
        )
        act_bytes = out_elems * base_layer.dtype_bytes(p.fprop_dtype or p.dtype)
        if p.to_outputs:
            every = {**shapes, **produced}
            out_shapes = tuple(every[k] for k in p.to_outputs)
        else:
            out_shapes = NestedMap({k: produced[k] if k in produced else shapes[k] for k in p.keep})
        return base_layer.Meta(2 * params * positions + out_elems, out_shapes, params, act_bytes)
