"""The loops' variable handles cross them packed (packed_handles.py), and TF still orders
the step's other uses of those variables around the loop.

Pinned: the inputs of the loops (training, eval's forward, FProp's two) and of their
branches do not grow with the layers per cell (a handle per variable did), a write of a weight after `ComputeGradients` in the same function waits for the
loop, one before it is waited for (both read off the traced graph, and by value), and the
packer leaves alone what it cannot pack.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe import fprop_context, gpipe, layers
from tf_gpipe.gpipe import packed_handles


def _pipe(num_layers, schedule='1f1b', tick_loop=True):
    fc = layers.FCLayer.Params().Set(input_dim=4, output_dim=4, activation='TANH')
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            random_seed=7,
            sub=[fc.Copy().Set(name=f'fc{i}') for i in range(num_layers)],
            num_partitions=2,
            partition_by='uniform',
            num_micro_batches=2,
            schedule=schedule,
            recompute='always',
            tick_loop=tick_loop,
            eval_loop=tick_loop,
        )
        .Instantiate()
    )


def _loss(y, t):
    return tf.reduce_mean(tf.reduce_sum((y - t) ** 2, -1))


X = tf.reshape(tf.range(32, dtype=tf.float32) / 32.0, [8, 4])
T = tf.ones([8, 4])


def _call(pipe, what):
    """The step `what` runs: a training step ('train'), eval's forward ('eval'), or FProp
    under a tape ('fprop': a forward and a backward loop)."""

    def train(x, t):
        return pipe.ComputeGradients(x, t, _loss)

    def evaluate(x, t):
        with fprop_context.eval_mode():
            return pipe.FProp(x)

    def fprop(x, t):
        with tf.GradientTape() as tape:
            loss = _loss(pipe.FProp(x), t)
        return loss, tape.gradient(loss, pipe.trainable_variables)

    return dict(train=train, eval=evaluate, fprop=fprop)[what]


def _loop_inputs(pipe, what):
    """Per While op of the traced step (in any function): (its inputs, [inputs of each Case
    or If in its body])."""
    graph = tf.function(_call(pipe, what)).get_concrete_function(X, T).graph.as_graph_def()
    functions = {f.signature.name: f for f in graph.library.function}
    nodes = list(graph.node) + [n for f in functions.values() for n in f.node_def]
    found = []
    for loop in sorted(
        (n for n in nodes if 'While' in n.op), key=lambda n: n.attr['body'].func.name
    ):
        body = functions[loop.attr['body'].func.name]
        branches = [n for n in body.node_def if n.op.endswith(('Case', 'If'))]
        found.append((len(loop.input), sorted(len(n.input) for n in branches)))
    return found


@pytest.mark.parametrize('what', ['train', 'eval', 'fprop'])
def test_the_loops_carry_as_many_tensors_whatever_the_layers_per_cell(what):
    schedule = 'gpipe' if what == 'fprop' else '1f1b'  # FProp under a tape: gpipe only
    few, many = (_loop_inputs(_pipe(n, schedule), what) for n in (2, 6))
    assert few == many, (few, many)
    assert len(few) == (2 if what == 'fprop' else 1), few
    assert all(branches for _, branches in few), 'no branch found in a loop body'


def _depends(graph, later, earlier):
    """Whether node `later` of a GraphDef reaches node `earlier` by data or control inputs."""
    inputs = {n.name: [i.lstrip('^').split(':')[0] for i in n.input] for n in graph.node}
    seen, todo = set(), [later]
    while todo:
        name = todo.pop()
        if name == earlier:
            return True
        if name not in seen:
            seen.add(name)
            todo.extend(inputs.get(name, []))
    return False


def test_writes_of_a_weight_around_the_loop_stay_ordered_with_it():
    pipe = _pipe(4)
    w = pipe.trainable_variables[0]  # read inside the loop by cell 0
    start = w.numpy()

    @tf.function
    def step(x, t):
        w.assign(start * 2.0)  # before: the loop must read this value
        loss, grads = pipe.ComputeGradients(x, t, _loss)
        w.assign(start * 3.0)  # after: not before the loop is done with w
        return loss, grads

    graph = step.get_concrete_function(X, T).graph.as_graph_def()
    (loop,) = [n.name for n in graph.node if n.op in ('While', 'StatelessWhile')]
    assigns = [n.name for n in graph.node if n.op == 'AssignVariableOp']
    assert len(assigns) == 2, assigns
    before, after = assigns  # in creation order
    assert _depends(graph, loop, before), 'the loop does not wait for the write before it'
    assert _depends(graph, after, loop), 'the write after the loop does not wait for it'

    loss, grads = step(X, T)
    w.assign(start * 2.0)
    want_loss, want_grads = tf.function(lambda x, t: pipe.ComputeGradients(x, t, _loss))(X, T)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for g, want in zip(grads, want_grads):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_the_packer_leaves_single_and_symbolic_handles_alone():
    a, b = tf.Variable(1.0), tf.Variable(2.0)
    with tf.device('CPU:1'):
        c = tf.Variable(3.0)
    seen = {}

    @tf.function
    def f():
        packer = packed_handles.HandlePacker()
        symbolic = tf.identity(a.handle)  # a tensor of this graph: left as it is
        args = packer.Args([a.handle, b.handle, c.handle, symbolic, tf.constant(1.0)])
        seen['same'] = [x is y for x, y in zip(args, [a.handle, b.handle, c.handle, symbolic])]
        seen['ops'] = [x.op.type for x in args[:2]]
        again = packer.Args([a.handle, b.handle])
        stacks = {x.op.inputs[0].ref() for x in args[:2] + again}
        seen['stacks'] = len(stacks)
        return [tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32) for h in args[:3]]

    values = f()
    assert seen['same'] == [False, False, True, True]  # c: the only handle on its device
    assert seen['stacks'] == 1  # a second branch with the same handles reuses the stack
    assert seen['ops'] == ['Unpack', 'Unpack']
    assert [float(v) for v in values] == [1.0, 2.0, 3.0]
