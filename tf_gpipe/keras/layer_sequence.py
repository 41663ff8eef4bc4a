"""A Keras model as the layer sequence GPipe cuts: a Sequential's layers or a functional
model's calls (keras/functional.py), their shapes, the checks on the model and the options, and
the cut points that `balance`, `cut_after` or the partitioner give."""

import difflib
import re

import keras
import numpy as np

from tf_gpipe.keras import checks, functional
from tf_gpipe.keras.layer import layer_config, make_layer
from tf_gpipe.keras.node import KerasNodeLayer
from tf_gpipe.nested_map import NestedMap


def output_template(model):
    """The structure of a functional model's outputs (None for one output), to pack a flat list."""
    if len(model.outputs) == 1:
        return None
    return keras.tree.map_structure(lambda _: 0, model.output)


def carries_mask(outputs):
    outs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return any(isinstance(out, NestedMap) for out in outs)


def check_model(model):
    """True for a functional model, False for a Sequential; anything else is refused."""
    if isinstance(model, keras.Sequential):
        return False
    if isinstance(model, keras.Model) and type(model).__name__ == 'Functional':
        return True
    if isinstance(model, keras.Model):
        raise TypeError(
            f'GPipe pipelines a keras.Sequential or a functional keras.Model (a graph of layer '
            f'calls); got the subclassed model {model.name!r}, whose call() is Python code with '
            'no graph to cut. Build it functionally (keras.Model(inputs, outputs)), or build a '
            'PipelinedLayer with cell_tpl.'
        )
    raise TypeError(f'GPipe takes a keras.Sequential or functional keras.Model, got {model!r}.')


def functional_sub(model):
    """(layers per step, KerasNodeLayer params, input (batch shape, dtype)s, output spec,
    the steps each output depends on)."""
    try:
        model.inputs[0]
    except (AttributeError, ValueError, IndexError, TypeError):
        raise ValueError(
            f'GPipe needs the input shape of {model.name!r}: start it with keras.Input(shape=...).'
        ) from None
    steps, inputs, outputs, specs = functional.steps_of(model)
    if not steps:
        raise ValueError(f'The model {model.name!r} has no layers to pipeline.')
    originals = [step.layer for step in steps]
    checks.check_supported(originals)
    sub = []
    for i, (name, step) in enumerate(zip(param_names(originals), steps)):
        sub.append(
            KerasNodeLayer.Params().Set(
                name=name,
                keras_layer=type(step.layer),
                config=layer_config(step.layer),
                input_shape=[list(s) for s in step.arg_shapes],
                args=step.args,
                arg_dtypes=step.arg_dtypes,
                outputs=step.outputs,
                call_kwargs=step.call_kwargs,
                keep=step.keep,
                from_inputs=inputs if i == 0 else [],
                to_outputs=outputs if i == len(steps) - 1 else [],
                autocast=False,
            )
        )
    out_specs = [keras.KerasTensor(specs[k][0], dtype=specs[k][1]) for k in outputs]
    reach = functional.reaching(steps, outputs)
    # Several outputs come back as a list, as from the plain model built with a list.
    return (
        originals,
        sub,
        [specs[k] for k in inputs],
        (out_specs if len(out_specs) > 1 else out_specs[0]),
        reach,
    )


_OPTIONS = (
    'num_partitions',
    'balance',
    'cut_after',
    'num_micro_batches',
    'recompute',
    'schedule',
    'virtual_stages',
    'devices',
    'partition_by',
    'jit_compile',
    'tick_loop',
    'eval_loop',
    'cell_grappler',
    'input_shape',
    'input_dtype',
    'name',
)


def check_options(kwargs):
    """A misspelt GPipe option names the closest one (Keras alone says 'Unrecognized keyword
    arguments'); anything else goes on to keras.Model."""
    for key in kwargs:
        close = difflib.get_close_matches(key, _OPTIONS, n=1, cutoff=0.75)
        if close:
            raise TypeError(
                f'GPipe got an unknown argument {key!r} (did you mean {close[0]!r}?). Its '
                f'options: {", ".join(_OPTIONS)}.'
            )


def flat_layers(sequential):
    """The Sequential's layers, nested Sequentials expanded in place."""
    out = []
    for layer in sequential.layers:
        out.extend(flat_layers(layer) if isinstance(layer, keras.Sequential) else [layer])
    return out


def makes_mask(layer):
    return isinstance(layer, keras.layers.Masking) or (
        isinstance(layer, keras.layers.Embedding) and layer.mask_zero
    )


def batch_shape(sequential, input_shape, input_dtype):
    """(batch shape with None batch, input dtype) from input_shape or the built Sequential."""
    if input_shape is not None:
        return (None,) + tuple(input_shape), input_dtype or 'float32'
    try:
        spec = sequential.inputs[0]
    except (AttributeError, ValueError, IndexError, TypeError):
        spec = None
    if spec is None:
        raise ValueError(
            f'GPipe needs the input shape of {sequential.name!r}: start the Sequential with '
            'keras.Input(shape=...), or pass input_shape=(...) without the batch dimension.'
        )
    return (None,) + tuple(spec.shape[1:]), input_dtype or spec.dtype


def layer_shapes(layers, batch_shape, dtype):
    """Each layer's input (batch shape, dtype), and the model's output KerasTensor."""
    spec = keras.KerasTensor(batch_shape, dtype=dtype)
    shapes = []
    for layer in layers:
        shapes.append((tuple(spec.shape), spec.dtype))
        try:
            if layer.built:
                spec = layer.compute_output_spec(spec)
            else:
                with keras.StatelessScope():  # Builds a copy without allocating weights.
                    copy = make_layer(type(layer), layer_config(layer))
                    copy.build(spec.shape)
                    spec = copy.compute_output_spec(spec)
        except Exception as e:
            raise ValueError(
                f'Layer {layer.name!r} ({type(layer).__name__}) cannot take input shape '
                f'{tuple(spec.shape)}: {e}'
            ) from e
        if isinstance(spec, list | tuple):
            raise ValueError(
                f'Layer {layer.name!r} returns {len(spec)} outputs; a Sequential layer returns one.'
            )
    return shapes, spec


def balance_from_cuts(layers, cut_after, balance):
    """Layers per cell for cuts after the named layers (calls, in the running order)."""
    if balance is not None:
        raise ValueError('Give balance=... or cut_after=..., not both.')
    if isinstance(cut_after, str) or not cut_after:
        raise ValueError(f'cut_after must be a non-empty list of layer names, got {cut_after!r}.')
    names = [layer.name for layer in layers]
    ends = []
    for name in cut_after:
        where = [i for i, n in enumerate(names) if n == name]
        if not where:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f' (did you mean {close[0]!r}?)' if close else ''
            raise ValueError(f'cut_after: the model has no layer {name!r}{hint}.')
        if len(where) > 1:
            raise ValueError(
                f'cut_after: layer {name!r} is called {len(where)} times (at positions '
                f'{where} of {len(names)}); give balance=[...] to cut between its calls.'
            )
        if where[0] == len(names) - 1:
            raise ValueError(f'cut_after: {name!r} is the last layer; nothing would follow it.')
        ends.append(where[0] + 1)
    if ends != sorted(set(ends)):
        raise ValueError(
            f'cut_after must name layers in the order they run, each once: {list(cut_after)} '
            f'runs at positions {[e - 1 for e in ends]}.'
        )
    return [b - a for a, b in zip([0] + ends, ends + [len(names)])]


def splits(layers, num_partitions, balance, devices):
    """(K, ending indices from balance), or (K, None) for the partitioner to balance."""
    n = len(layers)
    if balance is not None:
        if num_partitions is not None and num_partitions != len(balance):
            raise ValueError(
                f'num_partitions={num_partitions} but balance={list(balance)} has '
                f'{len(balance)} entries; give one of them.'
            )
        if any(not isinstance(b, int | np.integer) or b < 1 for b in balance):
            raise ValueError(f'balance must be positive layer counts, got {list(balance)}.')
        if sum(balance) != n:
            raise ValueError(
                f'balance={list(balance)} covers {sum(balance)} layers; the model has {n}: '
                f'{", ".join(layer.name for layer in layers)}.'
            )
        return len(balance), [int(x) for x in np.cumsum(balance)]
    if num_partitions is None:
        if devices is not None:
            num_partitions = len(devices)
        else:
            from tf_gpipe.runtime import cluster

            num_partitions = cluster.current_mesh().num_stages
    return num_partitions, None  # K is checked against the layers by the PipelinedLayer


def param_names(layers):
    """Unique Python identifiers from the Keras layer names (our layer names must be)."""
    names, seen = [], set()
    for layer in layers:
        base = re.sub(r'\W', '_', layer.name)
        base = base if base and not base[0].isdigit() else f'layer_{base}'
        name, i = base, 1
        while name in seen:
            name, i = f'{base}_{i}', i + 1
        seen.add(name)
        names.append(name)
    return names
