"""Checks on a traced step's graph: where its ops will run."""

import tensorflow as tf

ASSIGNS = {'AssignVariableOp', 'AssignAddVariableOp', 'AssignSubVariableOp'}
# Ops TF's placer puts with their input, or that compute nothing (a While op: TF places each
# loop variable's control nodes beside its initial value; its body's ops have their devices).
_FOLLOWERS = {
    'Placeholder',
    'Const',
    'NoOp',
    'ReadVariableOp',
    'Identity',
    'While',
    'StatelessWhile',  # a loop whose branches are unordered calls (gpipe/unordered.py)
}


def _tail(device):
    return device.split('device:')[-1] if device else ''


def misplaced_updates(graph):
    """Assignments of a non-scalar value computed off its variable's device (a counter or a
    metric's total may come from anywhere), and fused updates (ResourceApplyAdam, ...) placed
    off their variable's device."""
    devices = {internal.ref(): external.device for external, internal in graph.captures}

    def device(tensor):  # as the placer will decide for a variable's reader or an identity
        op = tensor.op
        if op.device or op.type not in ('ReadVariableOp', 'Identity'):
            return op.device
        return devices.get(op.inputs[0].ref()) or device(op.inputs[0])

    bad = []
    for op in graph.get_operations():
        # A fused update (its variable, slots, ...) runs where the op is placed.
        if op.type.startswith('ResourceApply'):
            want = _tail(devices.get(op.inputs[0].ref(), ''))
            if want and _tail(op.device) != want:
                bad.append(f'{op.name}: on {_tail(op.device) or "no device"}, variable on {want}')
        if op.type in ASSIGNS and op.inputs[1].shape.rank != 0:
            want = _tail(devices.get(op.inputs[0].ref(), ''))
            got = _tail(device(op.inputs[1]))
            if want and got != want:
                bad.append(f'{op.name}: value from {got or "no device"}, variable on {want}')
    return bad


def bulk_unplaced(graph):
    """Unplaced ops with a non-scalar output: on a TF cluster, tensors the client computes."""
    return [
        f'{op.type}:{op.name}'
        for op in graph.get_operations()
        if not op.device
        and op.type not in _FOLLOWERS
        and any(o.dtype != tf.resource and o.shape.rank != 0 for o in op.outputs)
    ]


def ancestors(fdef, name):
    """Names of the nodes of FunctionDef `fdef` that node `name` waits for (data or control)."""
    inputs = {n.name: [i.lstrip('^').split(':')[0] for i in n.input] for n in fdef.node_def}
    seen, todo = set(), [name]
    while todo:
        for i in inputs.get(todo.pop(), []):
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return seen


_CALLS = {'PartitionedCall', 'StatefulPartitionedCall'}


def calls_run_elsewhere(graph_def):
    """Ops inside a called function that carry a device other than their call's: a function
    placed by its call (a cell, a device's gradient sums) runs there, from whichever device
    calls it, only if it was traced unplaced. Follows calls into calls."""
    functions = {f.signature.name: f for f in graph_def.library.function}
    bad, seen = [], set()

    def walk(name, device):
        if (name, device) in seen or name not in functions:
            return
        seen.add((name, device))
        for node in functions[name].node_def:
            if node.device and _tail(node.device) != device:
                bad.append(f'{name}/{node.name}: on {_tail(node.device)}, called on {device}')
            if node.op in _CALLS:
                walk(node.attr['f'].func.name, _tail(node.device) or device)

    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    for node in nodes:
        if node.op in _CALLS and node.device:
            walk(node.attr['f'].func.name, _tail(node.device))
    return bad
