"""A part of a traced graph as a function of its own (gpipe/graph_cut.py): it computes what the
whole graph computes, holds only what its fetches need, reads the variables as they are when
it runs, runs a fetched op, and refuses a needed tensor nobody feeds."""

import pytest
import tensorflow as tf

from tf_gpipe.gpipe import graph_cut


def _trace(v, counter):
    """A wrapped trace: y = tanh(x @ v) with the counter's update before x is read, and the
    gradient of sum(y * dy) to x and v."""
    parts = {}

    def body(x, dy):
        bump = counter.assign_add(1)
        with tf.control_dependencies([bump]):
            x_read = tf.identity(x)
        with tf.GradientTape() as tape:
            tape.watch(x_read)
            h = tf.matmul(x_read, v)
            y = tf.tanh(h)
        d_x, d_v = tape.gradient(y, [x_read, v], output_gradients=dy)
        parts.update(x=x_read, h=h, y=y, dy=dy, d_x=d_x, d_v=d_v, bump=bump)
        return y, d_x, d_v

    spec = tf.TensorSpec([2, 3], tf.float32)
    wrapped = tf.compat.v1.wrap_function(body, [spec, spec])
    return wrapped, parts


def _fixtures():
    v = tf.Variable(tf.reshape(tf.range(9, dtype=tf.float32), [3, 3]) / 10.0)
    counter = tf.Variable(0, dtype=tf.int64)
    x = tf.reshape(tf.range(6, dtype=tf.float32), [2, 3]) / 7.0
    dy = tf.ones([2, 3]) / 3.0
    return v, counter, x, dy


def test_a_backward_cut_from_its_residuals_computes_the_gradients_and_holds_no_forward_state():
    v, counter, x, dy = _fixtures()
    wrapped, p = _trace(v, counter)
    source = graph_cut.Source(wrapped.graph)
    backward = graph_cut.cut(source, [p['x'], p['h'], p['dy']], [p['d_x'], p['d_v']])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.tanh(tf.matmul(x, v))
    want = tape.gradient(y, [x, v], output_gradients=dy)
    got = backward(x, tf.matmul(x, v), dy)
    for g, w in zip(got, want):
        assert float(tf.reduce_max(tf.abs(g - w))) < 1e-6
    # The fed residual x's op waits for the counter's update: the cut does not hold it.
    graph = backward.get_concrete_function(x, x, dy).graph
    assert 'AssignAddVariableOp' not in [op.type for op in graph.get_operations()]
    assert int(counter) == 0
    # A variable is read when the cut runs, not when it was made.
    v.assign(v * 2.0)
    _, d_v = backward(x, tf.matmul(x, v), dy)
    with tf.GradientTape() as tape:
        y = tf.tanh(tf.matmul(x, v))
    assert float(tf.reduce_max(tf.abs(d_v - tape.gradient(y, v, output_gradients=dy)))) < 1e-6


def test_a_fetched_op_runs_and_a_fed_fetch_is_the_argument():
    v, counter, x, dy = _fixtures()
    wrapped, p = _trace(v, counter)
    source = graph_cut.Source(wrapped.graph)
    forward = graph_cut.cut(source, [p['x']], [p['y'], p['x'], p['bump'].op])
    y, same, nothing = forward(x)
    assert nothing is None and int(counter) == 1
    assert float(tf.reduce_max(tf.abs(same - x))) == 0.0
    assert float(tf.reduce_max(tf.abs(y - tf.tanh(tf.matmul(x, v))))) < 1e-6


def test_a_cut_after_a_token_waits_for_it():
    v, counter, x, dy = _fixtures()
    wrapped, p = _trace(v, counter)
    weights = graph_cut.cut(
        graph_cut.Source(wrapped.graph), [p['x'], p['dy']], [p['d_v']], after=True
    )
    graph = weights.get_concrete_function(tf.constant(0), x, dy).graph
    token = graph.inputs[0]
    assert any(token.op in op.control_inputs for op in graph.get_operations())
    (d_v,) = weights(tf.constant(0), x, dy)
    assert d_v.shape == [3, 3]


def test_a_needed_tensor_nobody_feeds_is_an_error():
    v, counter, x, dy = _fixtures()
    wrapped, p = _trace(v, counter)
    with pytest.raises(ValueError, match='neither fed nor captured'):
        graph_cut.cut(graph_cut.Source(wrapped.graph), [p['h']], [p['d_v']])


def test_a_graph_that_calls_a_function_is_cut_with_its_library():
    double = tf.function(lambda t: t * 2.0, autograph=False)

    def body(x):
        return tf.reduce_sum(double(x))

    wrapped = tf.compat.v1.wrap_function(body, [tf.TensorSpec([3], tf.float32)])
    graph = wrapped.graph
    source = graph_cut.Source(graph)
    assert source.graph_def.library.function  # the nested call's function is in the library
    total = graph_cut.cut(source, graph.inputs[:1], graph.outputs)
    (got,) = total(tf.constant([1.0, 2.0, 3.0]))
    assert float(got) == 12.0


def test_a_gradient_colocated_with_a_forward_op_left_out_is_cut_without_that_colocation():
    # tf.gradients colocates each gradient op with its forward op; a W cut holds the former.
    v = tf.Variable(tf.ones([3, 3]))

    def body(x, dy):
        return tf.gradients(tf.matmul(x, v), [v], grad_ys=[dy])

    spec = tf.TensorSpec([2, 3], tf.float32)
    graph = tf.compat.v1.wrap_function(body, [spec, spec]).graph
    source = graph_cut.Source(graph)
    assert any('_class' in node.attr for node in source.graph_def.node)
    weights = graph_cut.cut(source, graph.inputs[:2], graph.outputs)
    (d_v,) = weights(tf.ones([2, 3]), tf.ones([2, 3]))
    assert float(tf.reduce_sum(d_v)) == 18.0
