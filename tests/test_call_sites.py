"""No call of a cell's function in the tick loop's step gives Grappler's function optimizer a
reason to copy the function: every output of the call is read, and no argument is a
constant (or folds to one).

Grappler gives a call site with an unread output, or a constant argument, a copy of the
function of its own ("specialised"), made in the step's own pass and optimised apart at the
first call: with the last cell's fused forward-and-backward (1F1B's last cell), a second copy
of the biggest function in the step (docs/engine.md). Pinned for every schedule and
recompute policy, with and without the outputs returned. Known and left: zero-bubble's
residuals are unpacked by one small call that B and W each read part of (carried.py).
"""

import pytest
import tensorflow as tf

from tf_gpipe import gpipe, layers

# Ops Grappler's constant folding turns into a constant when their inputs are constants.
_FOLDS = {'Identity', 'Fill', 'ZerosLike', 'OnesLike', 'Cast', 'Reshape', 'Pack', 'Shape'}
_FOLDS |= {'StridedSlice', 'Mul', 'AddV2', 'Sub', 'Range', 'Size', 'Rank', 'ShapeN'}
_LEFT = ('_unpack',)  # carried.py: known, see the module docstring


def specialisable_calls(graph_def):
    """[(caller, callee, constant arguments, unread outputs)] of every function call, in the
    outer graph and in each library function, that has either."""
    scopes = [
        (f.signature.name, list(f.node_def), list(f.ret.values()))
        for f in graph_def.library.function
    ]
    scopes.append(('(outer graph)', list(graph_def.node), []))
    found = []
    for caller, nodes, returned in scopes:
        by_name = {n.name: n for n in nodes}
        read = {i.lstrip('^') for n in nodes for i in n.input} | set(returned)
        for n in nodes:
            if n.op not in ('PartitionedCall', 'StatefulPartitionedCall'):
                continue
            data = [i for i in n.input if not i.startswith('^')]
            consts = [i for i in data if _constant(by_name, i)]
            unread = [k for k in range(len(n.attr['Tout'].list.type)) if not _read(n, k, read)]
            if consts or unread:
                found.append((caller, n.attr['f'].func.name, consts, unread))
    return found


def _constant(by_name, name, seen=()):
    """Whether tensor `name` is a constant or folds to one (an argument of the function,
    absent from `by_name`, does not)."""
    base = name.lstrip('^').split(':')[0]
    node = by_name.get(base)
    if node is None or base in seen:
        return False
    if node.op == 'Const':
        return True
    data = [i for i in node.input if not i.startswith('^')]
    return (
        node.op in _FOLDS
        and bool(data)
        and all(_constant(by_name, i, seen + (base,)) for i in data)
    )


def _read(call, k, read):
    """Whether output k of `call` is read: as "call:output:k" in a function, "call:k" (or
    "call" for k=0) in the outer graph."""
    names = {f'{call.name}:output:{k}', f'{call.name}:{k}'} | ({call.name} if k == 0 else set())
    return bool(names & read)


def _pipe(schedule, policy):
    fc = layers.FCLayer.Params().Set(input_dim=4, output_dim=4, activation='TANH')
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            random_seed=3,
            sub=[fc.Copy().Set(name=f'fc{i}') for i in range(4)],
            num_partitions=2,
            partition_by='uniform',
            num_micro_batches=2,
            recompute=policy,
            schedule=schedule,
            virtual_stages=2 if schedule == 'interleaved_1f1b' else 1,
            tick_loop=True,
        )
        .Instantiate()
    )


def _loss(y, t):
    return tf.reduce_mean(tf.reduce_sum((y - t) ** 2, -1))


X = tf.reshape(tf.range(32, dtype=tf.float32) / 32.0, [8, 4])
T = tf.ones([8, 4])


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble'])
@pytest.mark.parametrize('policy', ['never', 'except_last', 'always'])
def test_no_call_of_a_cell_function_is_specialisable(schedule, policy):
    pipe = _pipe(schedule, policy)
    for outputs in (False, True):

        def step(x, t, outputs=outputs):
            return pipe.ComputeGradients(x, t, _loss, return_outputs=outputs)

        graph = tf.function(step, autograph=False).get_concrete_function(X, T).graph.as_graph_def()
        calls = [c for c in specialisable_calls(graph) if not any(k in c[1] for k in _LEFT)]
        assert calls == [], (schedule, policy, outputs, calls)


def test_the_check_sees_an_unread_output_and_a_constant_argument():
    @tf.function(autograph=False, experimental_attributes={'_noinline': True})
    def two(x, y):
        return x + y, x * y

    def step(x):
        first, _ = two(x, tf.constant(2.0))  # the second output is never read
        return first

    graph = tf.function(step, autograph=False).get_concrete_function(X).graph.as_graph_def()
    [(caller, callee, consts, unread)] = specialisable_calls(graph)
    assert caller == '(outer graph)' and 'two' in callee
    assert len(consts) == 1 and unread == [1]
