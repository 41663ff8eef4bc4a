"""Calls of a cell's backward that TF builds once, not once per micro-batch.

The unrolled executor makes a call op per action, 2KM at K cells and M micro-batches, and TF
works through the called function's whole body at each call op, twice where once per
function would do:

- At trace time, adding a call op runs shape inference over the called function's body
  (constant evaluation included). The shapes are known already: the function was traced for
  these inputs. A call made here carries TF's node attribute `_disable_call_shape_inference`
  (what TF's own v1 `Defun` sets on its calls) and takes its output shapes from the trace.
- At the first call, Grappler's function optimizer and the lowering of function calls build
  the body of every call op's function to see whether to inline it (it is `_noinline`, so
  they do not). With `trampolines`, the step calls a trampoline, a function whose body is one
  call of the cell's function: they build the trampoline's one node per call op, and the
  cell's body is built when the trampoline is instantiated, once per device.

A loop's body is traced once and each of its call sites runs many times, so there a
trampoline would only add a function (a trace, an instantiation per device, a call per
action): calls made inside `direct_calls()` (the tick loop, the backward loop) skip it.

Only for calls no tape needs: a call made here is not recorded by a `tf.GradientTape` and
does not tell one which variables it reads, so the executor uses it for the recompute-backward
calls (their outputs are gradients), the gradient sums and the forwards nothing records (a
recomputed micro-batch's, the tick loop's, the fused forward-and-backward), never for a
forward a tape may differentiate. Graph mode only (eagerly a call infers no shapes and has no
passes).
"""

import contextlib
import threading

import tensorflow as tf

_NO_SHAPE_INFERENCE = '_disable_call_shape_inference'

# Per thread: a tf.distribute strategy traces each replica's loop in a thread of its own.
_state = threading.local()


@contextlib.contextmanager
def direct_calls():
    """Calls made inside go to their function directly, never through a trampoline: for the
    body of a loop, whose call sites are made once whatever the number of micro-batches."""
    previous = getattr(_state, 'direct', False)
    _state.direct = True
    try:
        yield
    finally:
        _state.direct = previous


def trace(fn, *args):
    """`fn` traced for `args` (tensors or TensorSpecs) as a function TF never inlines: one
    trace to call directly, for helpers whose tf.function would otherwise be asked for its
    trace with Python values as arguments at every call. Traced unplaced: one trace serves
    calls on every device (cells of the same shapes share it), each call placing it where
    the call is; traced under a device scope, it would run there from every device."""
    function = tf.function(fn, autograph=False, experimental_attributes={'_noinline': True})
    with tf.device(None):
        return function.get_concrete_function(*args)


def _types(tensors):
    return tf.compat.v1.AttrValue(
        list=tf.compat.v1.AttrValue.ListValue(type=[t.dtype.as_datatype_enum for t in tensors])
    )


def call(concrete, args, config_proto=b'', trampolines=None, stateful=True):
    """The outputs of one call of `concrete` (a traced function) on the flat tensors `args`
    (its inputs, captures included), shaped as traced. `config_proto`: the call op's options
    (grappler.config_proto). With `trampolines` (a dict the caller keeps), the call goes
    through `concrete`'s trampoline (below), made once and kept there, unless inside
    `direct_calls()`. `stateful=False`: a function of its inputs alone (no state read or
    written)."""
    if trampolines is not None and not getattr(_state, 'direct', False):
        concrete = _trampoline(concrete, args, config_proto, trampolines)
    return _raw(concrete, args, config_proto, stateful)


def _trampoline(concrete, args, config_proto, cache):
    """A function whose body is one call of `concrete`, traced once per function, options and
    argument signature (not per call site). At the first call of a step, each call op makes
    TF's passes over the step (Grappler's function optimizer, the lowering of function calls)
    build the called function's body to see whether to inline it (it is `_noinline`); through
    a trampoline, they build the trampoline's one node, and a cell's backward is built when
    the trampoline is instantiated, once per device, instead of once per micro-batch."""
    key = (concrete.name, config_proto, tuple((t.dtype, tuple(t.shape)) for t in args))
    if key not in cache:

        def trampoline(*flat):
            return _raw(concrete, list(flat), config_proto)

        fn = tf.function(
            trampoline,
            input_signature=[tf.TensorSpec(t.shape, t.dtype) for t in args],
            autograph=False,
            experimental_attributes={'_noinline': True},
        )
        cache[key] = fn.get_concrete_function()
    return cache[key]


# Ops that only read the resource they take, as TF's automatic control dependencies count
# them (besides an op whose _read_only_resource_inputs names the input).
_READ_OPS = frozenset(['ReadVariableOp', 'ResourceGather', 'ResourceGatherNd', 'VariableShape'])
_READ_ONLY = '_read_only_resource_inputs'
_read_only_cache = {}  # function name -> its read-only resource input indices


def read_only_inputs(concrete):
    """Indices of `concrete`'s resource inputs that its body only reads.

    TF's automatic control dependencies take every resource input of a call op without the
    `_read_only_resource_inputs` attribute for a write, and order all ops that take the same
    resource one after another: two cells that read one tied variable on two devices would
    then run in lockstep. A tf.function call carries the attribute; a call made here carries
    it too, computed as TF does (every consumer a known read or a call that reads it only),
    following Identity (a cut part re-captures each handle through one)."""
    if concrete.name not in _read_only_cache:
        out = []
        for i, t in enumerate(concrete.graph.inputs):
            if t.dtype == tf.resource and _only_read(t):
                out.append(i)
        _read_only_cache[concrete.name] = out
    return _read_only_cache[concrete.name]


def _only_read(tensor):
    for op in tensor.consumers():
        if op.type == 'Identity':
            if not _only_read(op.outputs[0]):
                return False
        elif op.type not in _READ_OPS:
            try:
                indices = op.get_attr(_READ_ONLY)
            except ValueError:
                return False
            if not any(op.inputs[j] is tensor for j in indices):
                return False
    return True


def _raw(concrete, args, config_proto, stateful=True):
    graph = tf.compat.v1.get_default_graph()
    concrete.add_to_graph(graph)
    outputs = concrete.outputs
    attrs = {
        'f': tf.compat.v1.AttrValue(func=tf.compat.v1.NameAttrList(name=concrete.name)),
        'Tin': _types(args),
        'Tout': _types(outputs),
        'config_proto': tf.compat.v1.AttrValue(s=config_proto),
        _NO_SHAPE_INFERENCE: tf.compat.v1.AttrValue(b=True),
        _READ_ONLY: tf.compat.v1.AttrValue(
            list=tf.compat.v1.AttrValue.ListValue(i=read_only_inputs(concrete))
        ),
    }
    # A function of its inputs alone (`stateful=False`: the gradient sums) is a PartitionedCall,
    # which automatic control dependencies leave alone: they chain every stateful op without
    # a resource input to the one before it, across devices too.
    op = graph.create_op(
        'StatefulPartitionedCall' if stateful else 'PartitionedCall',
        list(args),
        [t.dtype for t in outputs],
        attrs=attrs,
    )
    for out, traced in zip(op.outputs, outputs):
        out.set_shape(traced.shape)
    return list(op.outputs)


def call_structured(concrete, args, captures, config_proto=b'', trampolines=None):
    """One call of `concrete` (traced with the args' structure) with `captures` in place of
    its captured values: its structured outputs. None when the args' tensors do not match its
    inputs (then the caller calls its tf.function, which traces what it needs)."""
    flat = [t for t in tf.nest.flatten(args, expand_composites=True) if isinstance(t, tf.Tensor)]
    params = concrete.inputs[: len(concrete.inputs) - len(captures)]
    if len(flat) != len(params) or any(
        t.dtype != p.dtype or not p.shape.is_compatible_with(t.shape) for t, p in zip(flat, params)
    ):
        return None
    outputs = call(concrete, flat + list(captures), config_proto, trampolines)
    leaves = tf.nest.flatten(concrete.structured_outputs, expand_composites=True)
    it = iter(outputs)
    rebuilt = [None if leaf is None else next(it) for leaf in leaves]
    return tf.nest.pack_sequence_as(concrete.structured_outputs, rebuilt, expand_composites=True)
