"""Twin cells (twins.py): cells of the same layers share one trace of their forward and
their backward.

Pinned here: which forwards count as the same computation (names and devices aside, never a
different constant or variable shape); a shared call with another cell's captures computes
that cell's function, sparse gradients included; in a pipeline of identical cells, the middle
cells call one backward function and the first three one forward, each on its own device,
with no device inside it; cells that differ trace their own (another activation; dropout,
whose seed is a constant of the layer's name); and every schedule and recompute policy,
unrolled and as a tick loop, gives the numbers of the pipeline whose cells trace their own
(itself checked against the plain layer sequence in test_pipelined_layer.py).
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe import gpipe, layers
from tf_gpipe.gpipe import twins

K = 4


def _reduce(v, scale=2.0):
    @tf.function(autograph=False)
    def f(x):
        return tf.reduce_sum(x * v * scale)

    return f.get_concrete_function(tf.TensorSpec([3]))


def test_capture_map_needs_the_same_computation_and_like_values():
    a, b = tf.Variable(tf.ones([3]), name='a'), tf.Variable(tf.ones([3]) * 2, name='b')
    c = tf.Variable(tf.ones([1]), name='c')  # broadcasts: the same ops, another shape
    variable_of = {id(v.handle): v for v in (a, b, c)}
    with tf.device('/CPU:1'):
        fb = _reduce(b)
    mapping = twins.capture_map(_reduce(a), fb, variable_of)
    assert mapping == {id(a.handle): b.handle}
    assert twins.capture_map(_reduce(a), _reduce(b, 3.0), variable_of) is None
    assert twins.capture_map(_reduce(a), _reduce(c), variable_of) is None
    assert twins.capture_map(_reduce(a), _reduce(b), {}) is None  # variables not known


def test_a_forward_is_read_once_however_many_twins_it_is_compared_with(monkeypatch):
    reads = collections.Counter()
    read = twins._read

    def counted(concrete):
        reads[concrete.name] += 1
        return read(concrete)

    monkeypatch.setattr(twins, '_read', counted)
    a, b, c = (tf.Variable(tf.ones([3]), name=n) for n in 'abc')
    variable_of = {id(v.handle): v for v in (a, b, c)}
    first = _reduce(a)
    assert twins.capture_map(first, _reduce(b), variable_of) is not None
    assert twins.capture_map(first, _reduce(c), variable_of) is not None
    assert sorted(reads.values()) == [1, 1, 1]  # first, b's and c's, each once


def _sub(dropout=False, layers_per_cell=2, relu_cell=None):
    """2K tanh FC layers (relu in cell `relu_cell`), with a dropout layer at the start of each
    cell if asked."""
    fc = layers.FCLayer.Params().Set(input_dim=6, output_dim=6, activation='TANH')
    drop = layers.DropoutLayer.Params().Set(keep_prob=0.7)
    sub = []
    for i in range(2 * K):
        act = 'RELU' if i // layers_per_cell == relu_cell else 'TANH'
        sub.append(fc.Copy().Set(name=f'fc{i}', activation=act))
        if dropout and i % layers_per_cell == 0:
            sub.append(drop.Copy().Set(name=f'drop{i}'))
    return sub


def _pipe(schedule, policy, loop, twin, dropout=False, m=4, relu_cell=None, grappler=False):
    v = 2 if schedule == 'interleaved_1f1b' else 1
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            random_seed=1234,  # the same weights and dropout masks in both pipelines
            sub=_sub(dropout, 2 // v, relu_cell),  # 2K cells of one layer if v=2
            num_partitions=K,
            partition_by='uniform',
            num_micro_batches=m,
            recompute=policy,
            schedule=schedule,
            virtual_stages=v,
            tick_loop=loop,
            twin_cells=twin,
            cell_grappler=grappler,
        )
        .Instantiate()
    )


def _loss(y, t):
    return tf.reduce_mean(tf.reduce_sum((y - t) ** 2, -1))


def _data():
    x = tf.random.stateless_normal([8, 6], [1, 2])
    return x, tf.random.stateless_normal([8, 6], [3, 4])


def _run(pipe):
    fn = tf.function(lambda x, t: pipe.ComputeGradients(x, t, _loss), autograph=False)
    loss, grads = fn(*_data())
    return fn, np.asarray(loss), [np.asarray(tf.convert_to_tensor(g)) for g in grads]


def _backward_calls(fn, kind='Backward'):
    """{device: set of backward (or `kind`) function names} over the traced step, outer graph
    and library."""
    graph = fn.get_concrete_function(*_data()).graph.as_graph_def()
    calls = collections.defaultdict(set)
    bodies = {f.signature.name: f for f in graph.library.function}
    for node in list(graph.node) + [n for f in graph.library.function for n in f.node_def]:
        name = node.attr['f'].func.name if 'f' in node.attr else ''
        if 'trampoline' in name:  # call_op's: one call of the backward, placed by this node
            (inner,) = [n for n in bodies[name].node_def if n.op.endswith('PartitionedCall')]
            name = inner.attr['f'].func.name
        if kind in name and 'ForwardBackward' not in name and node.device:
            calls[node.device.split('/')[-1]].add(name)
    return calls, bodies


def _options_by_device(fn):
    """{device: config_protos of its trampoline calls}."""
    graph = fn.get_concrete_function(*_data()).graph.as_graph_def()
    options = collections.defaultdict(set)
    for node in list(graph.node) + [n for f in graph.library.function for n in f.node_def]:
        if 'trampoline' in node.attr['f'].func.name and node.device:
            options[node.device.split('/')[-1]].add(node.attr['config_proto'].s)
    return options


@pytest.mark.parametrize('grappler', [False, True], ids=['cells_without_grappler', 'grappler'])
@pytest.mark.parametrize('loop', [False, True], ids=['unrolled', 'tick_loop'])
def test_the_first_cells_share_one_backward_trace_and_the_first_calls_its_part(loop, grappler):
    """Cells 1 and 2 call one backward, each on its own device, with no device inside it; the
    first cell wants its variables' gradients alone and calls that part of the same trace,
    cut from it (graph_cut.py): no second trace, and no input gradient computed for nothing,
    whatever Grappler does. The last cell's micro-batches are kept (a fused call)."""
    fn, *_ = _run(_pipe('1f1b', 'except_last', loop, True, grappler=grappler))
    calls, bodies = _backward_calls(fn)
    assert set(calls) == {'device:CPU:0', 'device:CPU:1', 'device:CPU:2'}
    (shared,) = calls['device:CPU:1']
    (part,) = calls['device:CPU:0']
    assert calls['device:CPU:2'] == {shared} and part != shared
    assert 'BackwardUnplaced' in shared and 'Backward_variables' in part
    for name in (shared, part):
        assert all(not n.device for n in bodies[name].node_def)  # placed by its caller
    # The part returns the weight and bias gradients of its two layers, not d x, and holds
    # one matmul fewer: the first layer's input gradient (two in the forward, each layer's
    # weight gradient, the second layer's input gradient).
    outputs = {name: len(bodies[name].signature.output_arg) for name in (shared, part)}
    assert outputs == {shared: 5, part: 4}
    matmuls = {name: [n.op for n in bodies[name].node_def].count('MatMul') for name in outputs}
    assert matmuls == {shared: 6, part: 5}
    # Nothing asks Grappler to prune: every call follows cell_grappler.
    for device, protos in _options_by_device(fn).items():
        for proto in protos:
            config = tf.compat.v1.ConfigProto.FromString(proto)
            assert config.graph_options.rewrite_options.disable_meta_optimizer != grappler, device

    fn, *_ = _run(_pipe('1f1b', 'except_last', loop, False))
    calls, _ = _backward_calls(fn)
    assert len(set().union(*calls.values())) == 3  # each cell its own trace


@pytest.mark.parametrize('loop', [False, True], ids=['unrolled', 'tick_loop'])
def test_the_first_cells_call_one_forward_each_on_its_own_device(loop):
    """Cells 0, 1 and 2 recompute every micro-batch: each calls the first cell's forward on its
    own device, with no device inside it (the twins' traces prove it and are not called, so
    the step's library holds one forward for the three); without twins, each its own."""
    fn, *_ = _run(_pipe('1f1b', 'except_last', loop, True))
    calls, bodies = _backward_calls(fn, '_Forward_')
    assert set(calls) == {f'device:CPU:{d}' for d in range(3)}
    (shared,) = set().union(*calls.values())
    assert all(calls[device] == {shared} for device in calls)
    assert all(not n.device for n in bodies[shared].node_def)  # placed by its caller
    assert [name for name in bodies if '_Forward_' in name] == [shared]

    fn, *_ = _run(_pipe('1f1b', 'except_last', loop, False))
    calls, bodies = _backward_calls(fn, '_Forward_')
    assert len(set().union(*calls.values())) == 3
    for name in set().union(*calls.values()):
        assert all(n.device for n in bodies[name].node_def if n.op == 'MatMul')


def test_cells_that_differ_trace_their_own():
    # The same layer classes and variables, another activation: not the same forward.
    fn, *_ = _run(_pipe('1f1b', 'except_last', False, True, relu_cell=2))
    calls, _ = _backward_calls(fn)
    # Cells 0 and 1 share theirs (cell 0 calls its part: the previous test), cell 2 its own.
    ((c0,), (c1,), (c2,)) = [calls[f'device:CPU:{d}'] for d in range(3)]
    assert 'Backward_variables' in c0 and 'BackwardUnplaced' in c1
    assert '_Backward_' in c2 and 'Unplaced' not in c2


def test_cells_with_dropout_trace_their_own():
    # Dropout's seed is a function of the layer's name, a constant in each cell's forward.
    fn, *_ = _run(_pipe('1f1b', 'except_last', False, True, dropout=True))
    calls, _ = _backward_calls(fn)
    assert len(set().union(*calls.values())) == 3


SCHEDULES = ['gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble']


@pytest.mark.parametrize('loop', [False, True], ids=['unrolled', 'tick_loop'])
@pytest.mark.parametrize('policy', ['never', 'except_last', 'always'])
@pytest.mark.parametrize('schedule', SCHEDULES)
def test_twins_compute_what_cells_with_their_own_traces_compute(schedule, policy, loop):
    _, loss, grads = _run(_pipe(schedule, policy, loop, True))
    _, want_loss, want_grads = _run(_pipe(schedule, policy, loop, False))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert len(grads) == len(want_grads)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('loop', [False, True], ids=['unrolled', 'tick_loop'])
@pytest.mark.parametrize('schedule', ['1f1b', 'zero_bubble'])
def test_cells_refused_as_twins_stay_exact(schedule, loop):
    _, loss, grads = _run(_pipe(schedule, 'always', loop, True, dropout=True))
    _, want_loss, want_grads = _run(_pipe(schedule, 'always', loop, False, dropout=True))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
