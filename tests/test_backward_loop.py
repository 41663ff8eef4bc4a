"""Training FProp under a tape as two loops (forward_loop.py with a stash, backward_loop.py;
tick_loop=True) gives the unrolled executor's outputs and gradients, and its program does not
grow with M.

Compared on the same weights and dropout masks: K = 2 and 4, M = 3 and 4, 'always' and
'except_last' (which the loops run as 'always': the same numbers, one more forward per cell),
the inputs' and every weight's gradient, a sparse embedding gradient that stays sparse, a batch
dimension other than 0, XLA-compiled cells (eval's loop too); 'never' runs unrolled and the
log says why.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.test_tick_loop import _sub  # the same FC stack with dropout (and an embedding)
from tf_gpipe import gpipe


def _pipe(loop, m=4, k=2, policy='always', embedding=False, **kw):
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            random_seed=1234,  # same weights and dropout masks in both pipelines
            sub=_sub(embedding),
            num_partitions=k,
            partition_by='uniform',
            num_micro_batches=m,
            recompute=policy,
            tick_loop=loop,
            **kw,
        )
        .Instantiate()
    )


def _grads(pipe, x, w):
    """(outputs, d inputs or None, weight gradients) of sum(FProp(x) * w), traced."""

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = pipe.FProp(x)
            loss = tf.reduce_sum(y * w)
        d_x, *d_vars = tape.gradient(loss, [x] + list(pipe.trainable_variables))
        return y, d_x, d_vars

    return step, step(x)


def _close(got, want):
    for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        a, b = np.asarray(tf.convert_to_tensor(a)), np.asarray(tf.convert_to_tensor(b))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, np.max(np.abs(b))))


def _while_loops(graph):
    return sum(op.type in ('While', 'StatelessWhile') for op in graph.get_operations())


@pytest.mark.parametrize('k,m', [(2, 4), (4, 3)])
@pytest.mark.parametrize('policy', ['always', 'except_last'])
def test_equals_the_unrolled_executor(k, m, policy):
    x = tf.random.stateless_normal([4 * m, 6], [1, 2])
    w = tf.random.stateless_normal([4 * m, 6], [3, 4])
    _, want = _grads(_pipe(False, m, k, policy), x, w)
    step, got = _grads(_pipe(True, m, k, policy), x, w)
    _close(got, want)
    # The forward's loop, and the backward's in the gradient function.
    assert _while_loops(step.get_concrete_function(x).graph) == 2


def test_a_sparse_gradient_stays_sparse_and_batch_dim_one():
    ids = tf.constant(np.arange(3 * 8).reshape(3, 8) % 5, tf.int32)  # time-major: [T, B]
    w = tf.random.stateless_normal([3, 8, 6], [5, 6])

    def grads(loop):
        pipe = _pipe(loop, embedding=True, batch_dim=1)

        @tf.function(autograph=False)
        def step(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(pipe.FProp(ids) * w)
            return tape.gradient(loss, pipe.trainable_variables)

        return pipe, step(ids)

    _, want = grads(False)
    pipe, got = grads(True)
    _close(got, want)
    emb = [g for v, g in zip(pipe.trainable_variables, got) if 'emb' in v.name]
    assert emb and all(isinstance(g, tf.IndexedSlices) for g in emb), emb


def test_the_program_does_not_grow_with_m():
    def nodes(m):
        x = tf.ones([2 * m, 6])
        step, _ = _grads(_pipe(True, m), x, tf.ones([2 * m, 6]))
        graph = step.get_concrete_function(x).graph.as_graph_def()
        return len(graph.node), sum(len(f.node_def) for f in graph.library.function)

    assert nodes(4) == nodes(8)


def test_never_runs_unrolled_and_says_why(caplog):
    x = tf.random.stateless_normal([8, 6], [1, 2])
    w = tf.random.stateless_normal([8, 6], [3, 4])
    _, want = _grads(_pipe(False, policy='never'), x, w)
    step, got = _grads(_pipe(True, policy='never'), x, w)
    _close(got, want)
    assert _while_loops(step.get_concrete_function(x).graph) == 0
    assert "recompute='never'" in caplog.text and 'runs unrolled' in caplog.text


def test_xla_cells():
    from tf_gpipe import fprop_context

    x = tf.random.stateless_normal([16, 6], [1, 2])
    w = tf.random.stateless_normal([16, 6], [3, 4])
    _, want = _grads(_pipe(False, jit_compile=True), x, w)
    step, got = _grads(_pipe(True, jit_compile=True), x, w)
    _close(got, want)
    assert _while_loops(step.get_concrete_function(x).graph) == 2
    outs = []
    for loop in (False, True):
        pipe = _pipe(False, jit_compile=True, eval_loop=loop)

        @tf.function(autograph=False)
        def run(x, pipe=pipe):
            with fprop_context.eval_mode():
                return pipe.FProp(x)

        outs.append(run(x))
        assert _while_loops(run.get_concrete_function(x).graph) == int(loop)
    _close(outs[1], outs[0])
