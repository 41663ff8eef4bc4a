"""call_op: a call of a traced function that takes its output shapes from the trace (no shape
inference through the body), computes what a tf.function call computes, and is what the
executor uses for backward calls, gradient sums and forwards no tape can record, never for a
forward a tape may need."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe import gpipe, layers
from tf_gpipe.gpipe import call_op

_ATTR = '_disable_call_shape_inference'


def test_a_call_takes_its_shapes_from_the_trace_and_computes_the_same():
    v = tf.Variable([1.0, 2.0, 3.0])

    @tf.function(autograph=False)
    def f(x):
        return x * v, tf.reduce_sum(x)

    concrete = f.get_concrete_function(tf.TensorSpec([None, 3]))
    seen = {}

    @tf.function(autograph=False)
    def step(x):
        ours = call_op.call(concrete, [x] + concrete.captured_inputs)
        seen['ours'] = ours
        return ours, f(x)

    x = tf.reshape(tf.range(6, dtype=tf.float32), [2, 3])
    ours, theirs = step(x)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)
    op = seen['ours'][0].op
    assert op.type == 'StatefulPartitionedCall' and op.get_attr(_ATTR) is True
    # The shapes the trace gives, not the call site's [2, 3] (TF's inference through the body
    # would find it; tests/test_private_apis.py pins that TF honours the attribute).
    assert seen['ours'][0].shape.as_list() == [None, 3]


def test_a_call_keeps_the_grappler_options_it_is_given():
    from tf_gpipe.gpipe import grappler

    @tf.function(autograph=False)
    def f(x):
        return x + 1.0

    concrete = f.get_concrete_function(tf.TensorSpec([2]))
    ops = []

    @tf.function(autograph=False)
    def step(x):
        out = call_op.call(concrete, [x], grappler.config_proto(False))
        ops.append(out[0].op)
        return out

    np.testing.assert_array_equal(step(tf.ones([2]))[0], [2.0, 2.0])
    assert ops[0].get_attr('config_proto') == grappler.config_proto(False) != b''


def test_a_shared_call_computes_with_the_captures_it_is_given():
    a = tf.Variable(tf.range(12, dtype=tf.float32)[:, None] * tf.ones([1, 3]))
    b = tf.Variable(tf.ones([12, 3]) * 0.5)
    ids = tf.constant([1, 4, 4])

    def backward(v):
        @tf.function(autograph=False)
        def f(x):
            with tf.GradientTape() as tape:
                y = tf.reduce_sum(tf.gather(v, ids) * x)
            return y, tape.gradient(y, v)  # IndexedSlices

        return f

    spec = tf.TensorSpec([3, 3])
    concrete = backward(a).get_concrete_function(spec)
    x = tf.reshape(tf.range(9, dtype=tf.float32), [3, 3])

    # Its captures: a's handle and the ids; b's handle in place of a's.
    captures = [b.handle if c is a.handle else c for c, _ in concrete.graph.captures]
    assert len(captures) == 2 and captures[0] is b.handle

    @tf.function(autograph=False)
    def shared(x):
        return call_op.call_structured(concrete, (x,), captures)

    y, g = shared(x)
    want_y, want_g = backward(b)(x)
    assert isinstance(g, tf.IndexedSlices)
    np.testing.assert_allclose(y, want_y)
    np.testing.assert_allclose(tf.convert_to_tensor(g), tf.convert_to_tensor(want_g))
    assert (
        call_op.call_structured(concrete, (x, x), captures) is None
    )  # another structure: not this one


def _calls(graph_def):
    """[(called function, skips shape inference?, called inside a trampoline?)] over the
    step's graph and the trampolines in its library."""
    bodies = {f.signature.name: f for f in graph_def.library.function}
    found = []

    def visit(nodes, inside):
        for node in nodes:
            if node.op.endswith('PartitionedCall'):
                name = node.attr['f'].func.name
                skip = node.attr[_ATTR].b if _ATTR in node.attr else False
                found.append((name, skip, inside))
                if 'trampoline' in name:
                    visit(bodies[name].node_def, True)

    visit(graph_def.node, False)
    return found


def _pipe(m, policy, twin_cells=True, tick_loop=False):
    fc = layers.FCLayer.Params().Set(input_dim=4, output_dim=4, activation='TANH')
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            sub=[fc.Copy().Set(name=f'fc{i}') for i in range(4)],
            num_partitions=2,
            partition_by='uniform',
            num_micro_batches=m,
            recompute=policy,
            schedule='1f1b',
            twin_cells=twin_cells,
            tick_loop=tick_loop,
        )
        .Instantiate()
    )


def _step_calls(pipe):
    x = tf.reshape(tf.range(24, dtype=tf.float32), [6, 4]) / 24.0

    def step():
        return pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y * y))

    return _calls(tf.function(step).get_concrete_function().graph.as_graph_def())


@pytest.mark.parametrize('twin_cells', [True, False], ids=['twins', 'own_backward'])
def test_backward_and_recomputed_forward_calls_go_through_trampolines(twin_cells):
    """In an unrolled ComputeGradients step, every recompute-backward and every recomputed
    forward (no tape records it) is called through a trampoline (one per cell and kind, not
    per micro-batch) and, like the gradient sums, without shape inference."""
    m = 3
    calls = _step_calls(_pipe(m, 'always', twin_cells))
    outer = [(n, skip) for n, skip, inside in calls if not inside]
    trampolines = [(n, skip) for n, skip in outer if 'trampoline' in n]
    inner = [(n, skip) for n, skip, inside in calls if inside]
    sums = [(n, skip) for n, skip in outer if 'accumulate' in n]
    assert len(trampolines) == 4 * m and all(skip for _, skip in trampolines), calls
    assert len({n for n, _ in trampolines}) == 4  # one per cell and kind, whatever M
    assert all(skip for _, skip in inner), calls
    assert sum('Backward' in n for n, _ in inner) == 2 * m, calls
    assert sum('Forward' in n for n, _ in inner) == 2 * m, calls
    assert sums and all(skip for _, skip in sums), calls
    assert not any('Backward' in n or 'Forward' in n for n, _ in outer), calls


def test_a_kept_forward_stays_a_tf_function_call():
    """A kept micro-batch's forward is recorded by a tape (its backward is the tape's): a
    tf.function call, with shape inference. The last cell's kept micro-batches are fused
    forward-and-backward calls, whose outputs no tape differentiates: through trampolines."""
    m = 3
    calls = _step_calls(_pipe(m, 'never'))
    outer = [(n, skip) for n, skip, inside in calls if not inside]
    inner = [(n, skip) for n, skip, inside in calls if inside]
    # TF's call of the forward a tape records is named __forward_<function> (it returns the
    # activations its backward, __backward_<function>, reads).
    kept = [(n, skip) for n, skip in outer if n.startswith('__forward__Forward')]
    assert len(kept) == m and not any(skip for _, skip in kept), calls
    assert sum('ForwardBackward' in n for n, _ in inner) == m, calls
    assert not any('ForwardBackward' in n for n, _ in outer), calls


def test_a_loop_calls_its_cells_without_trampolines():
    """The tick loop's body is traced once, each call site in it runs for every micro-batch:
    a trampoline there would only add a function. Its cells' calls are direct, still without
    shape inference."""
    pipe = _pipe(3, 'always', tick_loop=True)
    x = tf.reshape(tf.range(24, dtype=tf.float32), [6, 4]) / 24.0

    def step():
        return pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y * y))

    graph_def = tf.function(step).get_concrete_function().graph.as_graph_def()
    names = [f.signature.name for f in graph_def.library.function]
    assert not any('trampoline' in n for n in names), names
    cell_calls = [
        node
        for f in graph_def.library.function
        for node in f.node_def
        if node.op.endswith('PartitionedCall')
        and ('Forward' in node.attr['f'].func.name or 'Backward' in node.attr['f'].func.name)
    ]
    assert cell_calls and all(n.attr[_ATTR].b for n in cell_calls), cell_calls


@pytest.mark.parametrize('tied', [True, False], ids=['tied', 'untied'])
def test_an_unrolled_step_orders_no_two_devices_calls(tied):
    """Only data and the schedule order a step's calls across devices. TF's automatic control
    dependencies chain calls that write one resource, and stateful calls that take none:
    cell calls say which variables they only read (a softmax tied to cell 0's embedding reads
    it on the last device), and the gradient sums are stateless calls, so no call on one
    device waits for another device's by a control edge."""
    from tests.test_ownership import _tied_lm

    sub = _tied_lm()
    if not tied:
        sub[-1] = sub[-1].Copy().Set(tied_embedding=None)
    pipe = (
        gpipe.PipelinedLayer.Params()
        .Set(name='pipe', sub=sub, num_partitions=2, partition_by='uniform')
        .Set(num_micro_batches=4, schedule='1f1b', recompute='always')
        .Instantiate()
    )
    ids = tf.random.stateless_uniform([8, 6], [1, 1], 0, 16, tf.int32)
    softmax = pipe.cells[-1].sub[-1]

    def step():
        return pipe.ComputeGradients(
            ids, ids, lambda logits, y: softmax.XentLoss(logits, y).avg_xent
        )

    graph = tf.function(step).get_concrete_function().graph
    calls = [op for op in graph.get_operations() if op.type.endswith('PartitionedCall')]

    def device(op):
        spec = tf.DeviceSpec.from_string(op.device)
        return (spec.device_type, spec.device_index)

    assert {device(op) for op in calls} == {('CPU', 0), ('CPU', 1)}, [op.device for op in calls]
    crossing = [
        (c.name, op.name)
        for op in calls
        for c in op.control_inputs
        if c.type.endswith('PartitionedCall') and device(c) != device(op)
    ]
    assert not crossing, crossing
