"""A part of a traced graph as a function of its own: the ops some fetched tensors need, given
some fed ones, cut from the graph's GraphDef and imported into a new tf.function whose
arguments are the feeds.

`WrappedFunction.prune` makes the same function op by op in Python (lift_to_graph), and also
copies every op a fed tensor depends on (left unconnected, then pruned again): on a Transformer
cell's trace, zero-bubble's F, B and W cuts took most of the time its kept micro-batch spent
being traced. TF imports a GraphDef in C++. Only the public `tf.graph_util.import_graph_def`
is used; the graph's captured values (the variables' handles) are captured again by the new
function.
"""

import tensorflow as tf


def _key(name):
    """A tensor's name as a GraphDef input spells it: 'op' is 'op:0'."""
    return name if ':' in name else name + ':0'


class Source:
    """A traced graph read once for many cuts: its GraphDef and its captures."""

    def __init__(self, graph):
        self.graph_def = graph.as_graph_def()
        self.nodes = {node.name: node for node in self.graph_def.node}
        self.captures = {internal.name: external for external, internal in graph.captures}


def _colocate_within(node, kept):
    """Drops the node's colocation with ops left out of the cut (TF refuses to import a node
    colocated with one it does not have; a gradient op is colocated with its forward op)."""
    names = [c for c in node.attr['_class'].list.s if c.decode().removeprefix('loc:@') in kept]
    if names:
        del node.attr['_class'].list.s[:]
        node.attr['_class'].list.s.extend(names)
    else:
        del node.attr['_class']


def cut(source, feeds, fetches, name='cut', attributes=None, after=False, structure=None):
    """A tf.function named `name` of len(feeds) tensors (after a first one it waits for, if
    `after`) that returns the fetches (tensors of the source's graph; an op fetched runs and
    returns None), holding only the ops they need; packed as `structure` if given (composite
    tensors expanded). A placeholder they need that is neither fed nor captured is an error."""
    fed = {_key(t.name): i for i, t in enumerate(feeds)}
    fed_ops = {key.partition(':')[0] for key in fed}
    fetched = [f.name if isinstance(f, tf.Operation) else _key(f.name) for f in fetches]
    used_feeds, used_captures, inputs_of, needed = set(), set(), {}, set()
    stack = [key.partition(':')[0] for key in fetched if key not in fed]
    while stack:
        op = stack.pop()
        if op in needed:
            continue
        needed.add(op)
        node = source.nodes[op]
        kept = []
        for input_name in node.input:
            if input_name.startswith('^'):
                if input_name[1:] in fed_ops:
                    continue  # an argument is ready when the function starts
                stack.append(input_name[1:])
            else:
                key = _key(input_name)
                if key in fed:
                    used_feeds.add(key)
                elif key in source.captures:
                    used_captures.add(key)
                else:
                    stack.append(key.partition(':')[0])
            kept.append(input_name)
        inputs_of[op] = kept
        if node.op == 'Placeholder':
            raise ValueError(f'graph_cut: {op} is needed and neither fed nor captured')
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(source.graph_def.versions)
    graph_def.library.CopyFrom(source.graph_def.library)
    for node in source.graph_def.node:
        if node.name in needed:
            copy = graph_def.node.add()
            copy.CopyFrom(node)
            if len(inputs_of[node.name]) != len(node.input):
                del copy.input[:]
                copy.input.extend(inputs_of[node.name])
            if '_class' in copy.attr:
                _colocate_within(copy, needed)
    imported = [key for key in fetched if key not in fed]

    def run(*args):
        if after:
            token, args = args[0], args[1:]
            with tf.control_dependencies([token]):
                args = [tf.identity(a) for a in args]
        input_map = {key: args[fed[key]] for key in used_feeds}
        # A captured value enters the new function as its own capture.
        for key in source.captures:  # in the source's order: the same function every time
            if key in used_captures:
                input_map[key] = tf.identity(source.captures[key])
        out = iter(
            tf.graph_util.import_graph_def(
                graph_def, input_map=input_map, return_elements=imported, name='cut'
            )
            if imported
            else []
        )
        results = [args[fed[key]] if key in fed else next(out) for key in fetched]
        results = [None if isinstance(r, tf.Operation) else r for r in results]
        if structure is None:
            return results
        return tf.nest.pack_sequence_as(structure, results, expand_composites=True)

    run.__name__ = name
    return tf.function(run, autograph=False, experimental_attributes=attributes)
