"""Twin cells: cells that are the same layers share one trace of their forward and backward.

A stack of identical layers cut into K cells has K identical cells but for their variables.
Each cell's recompute-backward (its forward again under a tape, then its gradient) is the most
expensive trace of a pipeline step, so tracing it once for all of them cuts the step's trace
and its function library by up to K - 1 such traces (docs/engine.md, "Start-up: twin cells").
Each twin still traces its forward (the proof below), but calls the first cell's: the step's
function library, which Grappler and the runtime read at the first call, holds one forward.

Nothing is assumed from names or params: a cell is a twin of an earlier one only when their
traced forwards are the same graph, op for op (types, attributes, inferred shapes and wiring;
names and devices aside), with no nested function, and the values they capture correspond
one to one: variables of the same shape and dtype, or tensors of the same dtype and shape.
The twin's backward is the first cell's, traced once without device annotations and called on
the twin's device with the twin's captures in place of the first cell's; every value it
captures must be one its forward captured too, so each has a counterpart. The forwards of a
group's cells are traced without device annotations too, each call placed on its cell's
device. Anything else (a dropout seed that differs by layer name, a layer that branches on
its name, a tf.distribute strategy, a TPU mesh) makes a cell trace its own backward, as
before.
"""

import weakref

import tensorflow as tf

# Attributes that name other nodes (colocation) or say where an op runs: not the computation.
_IGNORED_ATTRS = frozenset(['_class'])


def _has_function(attr):
    return attr.HasField('func') or (attr.HasField('list') and len(attr.list.func) > 0)


# A group's first forward is compared with every twin's: its canonical form is read once.
_canonical = weakref.WeakKeyDictionary()


def canonical(concrete):
    """The computation of a traced function as comparable values, or None when it calls a
    nested function (not compared here). Also the positions of its captures' placeholders."""
    if concrete not in _canonical:
        _canonical[concrete] = _read(concrete)
    return _canonical[concrete]


def _read(concrete):
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    if graph_def.library.function:
        return None
    index = {node.name: i for i, node in enumerate(graph_def.node)}
    nodes = []
    for node in graph_def.node:
        inputs = []
        for name in node.input:
            if name.startswith('^'):
                inputs.append((index[name[1:]], -1))
            else:
                op, _, port = name.partition(':')
                inputs.append((index[op], int(port or 0)))
        attrs = []
        for key in sorted(node.attr):
            value = node.attr[key]
            if _has_function(value):
                return None
            if key not in _IGNORED_ATTRS:
                attrs.append((key, value.SerializeToString(deterministic=True)))
        nodes.append((node.op, tuple(inputs), tuple(attrs)))
    positions = tuple(index[internal.op.name] for _, internal in concrete.graph.captures)
    return tuple(nodes), positions


def _like(a, b, variable_of):
    """Whether captured values a (the first cell's) and b (the twin's) play the same part."""
    if a.dtype != b.dtype:
        return False
    if a.dtype == tf.resource:
        va, vb = variable_of.get(id(a)), variable_of.get(id(b))
        return (
            va is not None
            and vb is not None
            and va.dtype == vb.dtype
            and va.shape == vb.shape
            and va.trainable == vb.trainable
        )
    return a.shape == b.shape


def capture_map(first, twin, variable_of):
    """{id(first's captured value): twin's} when forwards `first` and `twin` (concrete
    functions) are the same computation, else None. `variable_of`: id(handle) -> variable."""
    a, b = canonical(first), canonical(twin)
    if a is None or a != b:
        return None
    first_values = [external for external, _ in first.graph.captures]
    twin_values = [external for external, _ in twin.graph.captures]
    if not all(_like(x, y, variable_of) for x, y in zip(first_values, twin_values)):
        return None
    return {id(x): y for x, y in zip(first_values, twin_values)}
