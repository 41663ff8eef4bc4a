"""A Keras model as a sequence of layer calls that carry the tensors still needed.

A functional model is read from its own config (the graph Keras saves: each call's argument
tensors by (layer, call, output) history) and ordered topologically; a model used as a layer
(a keras.applications backbone, a nested Sequential) is inlined, so it is cut like the rest.
Calls of Keras ops (`x + y`, `keras.ops.relu(x)`, the mask arithmetic Keras records) are steps
too; non-tensor arguments (`2.0` in `x * 2.0`) are kept as constants, and tensors passed by
keyword (`mask=`, `attention_mask=`) travel like positional ones.
For every step this gives the tensor keys it reads, the keys of its outputs and the keys to
keep after it: a tensor is kept from the step that makes it to the last step that reads it, so
skip connections cross the cells between without anyone declaring them.
"""

import dataclasses

import keras
import numpy as np

from tf_gpipe.keras.node import Const, map_leaves, tensor_keys


@dataclasses.dataclass
class Step:
    layer: object  # a keras.layers.Layer or a keras.Operation
    args: list  # nested lists of tensor keys and Consts
    call_kwargs: dict  # name: nested lists of tensor keys and Consts
    arg_dtypes: dict  # key: dtype, for every tensor key of args and call_kwargs
    arg_shapes: list  # one batch shape per key, in the order of tensor_keys(args, call_kwargs)
    outputs: list
    keep: list = dataclasses.field(default_factory=list)


class _Keys:
    """Tensor keys t0, t1, ... and their (batch shape, dtype)."""

    def __init__(self):
        self.specs = {}

    def new(self, shape, dtype):
        key = f't{len(self.specs)}'
        self.specs[key] = (tuple(shape), keras.backend.standardize_dtype(dtype))
        return key


def is_graph(layer):
    return isinstance(layer, keras.Model) and type(layer).__name__ in ('Functional', 'Sequential')


def steps_of(model):
    """(steps in topological order, input keys, output keys, {key: (shape, dtype)})."""
    keys = _Keys()
    inputs = [keys.new(t.shape, t.dtype) for t in model.inputs]
    steps, outputs = _expand(model, inputs, keys)
    needed = set(outputs)
    for step in reversed(steps):
        step.keep = sorted(needed, key=lambda k: int(k[1:]))
        needed = (needed - set(step.outputs)) | set(tensor_keys(step.args, step.call_kwargs))
    return steps, inputs, outputs, keys.specs


def reaching(steps, output_keys):
    """For each output key, the indices of the steps it depends on (a layer no loss-carrying
    output depends on gets no gradient, as in plain Keras)."""
    out = []
    for key in output_keys:
        needed, reached = {key}, set()
        for i in reversed(range(len(steps))):
            if needed & set(steps[i].outputs):
                reached.add(i)
                needed |= set(tensor_keys(steps[i].args, steps[i].call_kwargs))
        out.append(frozenset(reached))
    return out


def _expand(model, input_keys, keys):
    if type(model).__name__ == 'Sequential':
        return _expand_sequential(model, input_keys, keys)
    return _expand_functional(model, input_keys, keys)


def _expand_sequential(model, input_keys, keys):
    (key,) = input_keys
    steps = []
    for layer in model.layers:
        if is_graph(layer):
            inner, (key,) = _expand(layer, [key], keys)
            steps += inner
            continue
        shape, dtype = keys.specs[key]
        spec = layer.compute_output_spec(keras.KerasTensor(shape, dtype=dtype))
        out = keys.new(spec.shape, spec.dtype)
        steps.append(Step(layer, [key], {}, {key: dtype}, [shape], [out]))
        key = out
    return steps, [key]


def _histories(value):
    """Flat [keras_history] of the Keras tensors in a serialized argument."""
    if isinstance(value, dict) and value.get('class_name') == '__keras_tensor__':
        return [tuple(value['config']['keras_history'])]
    if isinstance(value, (list, tuple)):
        return [h for v in value for h in _histories(v)]
    if isinstance(value, dict):
        return [h for v in value.values() for h in _histories(v)]
    return []


def _triples(refs):
    """The (layer, node, index) triples of a config's input or output layers, flat in the
    order of model.inputs / model.outputs (nested lists walked, dicts by sorted key)."""
    if isinstance(refs, dict):
        return [t for key in sorted(refs) for t in _triples(refs[key])]
    if refs and isinstance(refs[0], str):
        return [tuple(refs)]
    return [t for r in refs for t in _triples(r)]


def _expand_functional(model, input_keys, keys):
    config = model.get_config()
    layers = {op.name: op for op in model.operations}  # layers and Keras ops
    inputs = {layer['name'] for layer in config['layers'] if layer['class_name'] == 'InputLayer'}
    local = dict(zip(_triples(config['input_layers']), input_keys))
    specs = {}  # history -> (shape, dtype), as the consumers' serialized tensors say

    def structure(value):
        """Tensors as their histories, lists walked, anything else a constant."""
        if isinstance(value, dict) and value.get('class_name') == '__keras_tensor__':
            history = tuple(value['config']['keras_history'])
            specs[history] = (value['config']['shape'], value['config']['dtype'])
            return history
        if isinstance(value, (list, tuple)):
            return [structure(v) for v in value]
        if _histories(value):
            raise ValueError(
                f'A call in {model.name!r} passes tensors inside a dict ({list(value)}); GPipe '
                'carries tensors passed positionally, by keyword, or in lists.'
            )
        if isinstance(value, dict) and value.get('class_name') in ('__tensor__', '__numpy__'):
            value = np.asarray(keras.saving.deserialize_keras_object(value))  # a constant
        return Const(value)

    nodes = []
    for order, layer_config in enumerate(config['layers']):
        name = layer_config['name']
        for index, node in enumerate(layer_config['inbound_nodes']):
            raw_kwargs = {k: v for k, v in node.get('kwargs', {}).items() if k != 'training'}
            args = [structure(a) for a in node['args']]
            kwargs = {k: structure(v) for k, v in raw_kwargs.items()}
            deps = {h[:2] for h in _histories([node['args'], list(raw_kwargs.values())])}
            nodes.append(((order, index), (name, index), args, deps, kwargs))
    for tensor, history in zip(model.outputs, _triples(config['output_layers'])):
        specs.setdefault(history, (tuple(tensor.shape), tensor.dtype))
    # A call's outputs that anything reads (a later call or the model), by tensor index.
    used = {}
    for history in specs:
        used[history[:2]] = max(used.get(history[:2], 0), history[2] + 1)
    # Topological order (Kahn), ties broken by the config's order.
    done, ordered, pending = {(n, 0) for n in inputs}, [], sorted(nodes, key=lambda n: n[0])
    while pending:
        ready = [n for n in pending if n[3] <= done]
        if not ready:
            raise ValueError(f'The graph of {model.name!r} has a cycle; GPipe needs a DAG.')
        pending.remove(ready[0])
        done.add(ready[0][1])
        ordered.append(ready[0])
    # Then in the order Keras runs the graph: by depth (the longest path to an output), deepest
    # first. It matters where a layer takes the mask off a tensor that others read later.
    depth = {}
    for node in reversed(ordered):
        readers = [depth[n[1]] + 1 for n in ordered if node[1] in n[3] and n[1] in depth]
        depth[node[1]] = max(readers, default=0)
    ordered.sort(key=lambda n: -depth[n[1]])  # stable: ties stay in the config's order
    steps = []
    for _, (name, index), args, _, kwargs in ordered:
        layer = layers[name]

        def to_keys(structure):
            return map_leaves(structure, lambda h: h if isinstance(h, Const) else local[h])

        arg_keys = to_keys(args)
        kwarg_keys = {k: to_keys(v) for k, v in kwargs.items()}
        if is_graph(layer):  # inline a model used as a layer: it is cut like the rest
            if tensor_keys([], kwarg_keys):
                raise ValueError(
                    f'The model {name!r} is called with a tensor keyword argument; GPipe '
                    'inlines nested models called with positional tensors only.'
                )
            inner, outs = _expand(layer, tensor_keys(arg_keys), keys)
            steps += inner
            for i, key in enumerate(outs):
                local[(name, index, i)] = key
            continue
        outs = []
        for i in range(used.get((name, index), 1)):
            shape, dtype = specs.get((name, index, i), (None, None))
            if shape is None:  # an output nothing reads: any spec will do
                shape, dtype = (None,), 'float32'
            local[(name, index, i)] = keys.new(shape, dtype)
            outs.append(local[(name, index, i)])
        flat = tensor_keys(arg_keys, kwarg_keys)
        steps.append(
            Step(
                layer=layer,
                args=arg_keys,
                call_kwargs=kwarg_keys,
                arg_dtypes={k: keys.specs[k][1] for k in flat},
                arg_shapes=[keys.specs[k][0] for k in flat],
                outputs=outs,
            )
        )
    return steps, [local[h] for h in _triples(config['output_layers'])]
