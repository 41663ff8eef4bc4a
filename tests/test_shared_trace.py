"""A cell's forward, recompute-backward and fused calls share one training trace
(recompute.CellRunner._Trained): each cell's layers are traced once per step, F runs only the
forward (its call site drops the gradients), and the cells that cannot share fall back to a
trace per kind of call. Exactness against the plain sequence and the unrolled executor is in
test_executor.py, test_pipelined_layer.py and test_tick_loop.py, which run on it."""

import numpy as np
import pytest
import tensorflow as tf

from tests import test_tick_loop as ttl
from tf_gpipe import gpipe, layers
from tf_gpipe.gpipe import executor, grad_lists, recompute


def _count_traces(monkeypatch):
    calls = []
    fprop = layers.FCLayer.FProp
    monkeypatch.setattr(
        layers.FCLayer, 'FProp', lambda self, x: calls.append(self.params.name) or fprop(self, x)
    )
    return calls


# Not here: the unrolled executor's gpipe under 'except_last' keeps each cell's last
# micro-batch, a forward under a tape of its own (CellRunner.ForwardKeep): a second trace.
@pytest.mark.parametrize(
    'schedule,policy,loop',
    [
        ('gpipe', 'except_last', True),
        ('1f1b', 'except_last', True),
        ('1f1b', 'except_last', False),
        ('1f1b', 'always', True),
        ('1f1b', 'always', False),
        ('gpipe', 'always', True),
        ('gpipe', 'always', False),
    ],
)
def test_each_cell_is_traced_once_for_its_forwards_recomputes_and_fused_calls(
    schedule, policy, loop, monkeypatch
):
    """Before, F, the recompute inside B and the fused call each traced the cell."""
    calls = _count_traces(monkeypatch)
    pipe = ttl._pipe(schedule, policy, 4, loop)
    x = tf.random.stateless_normal([8, 6], [1, 2])
    tf.function(lambda x: pipe.ComputeGradients(x, x, ttl._loss)).get_concrete_function(x)
    assert sorted(calls) == ['fc0', 'fc1', 'fc2', 'fc3']


def _runner_and_args():
    cell = (
        layers.SequentialLayer.Params()
        .Set(
            name='cell',
            sub=[layers.FCLayer.Params().Set(name='fc', input_dim=3, output_dim=3)],
        )
        .Instantiate()
    )
    runner = recompute.CellRunner(cell, None, 0)
    x = (tf.random.stateless_normal([2, 3], [1, 1]),)
    return runner, x, tf.constant(0, tf.int64), tf.constant(5, tf.int64)


def test_a_forward_call_runs_without_the_gradients_it_is_given_no_room_for():
    """F passes empty gradient lists: its call site must drop the gradients (Grappler's
    specialisation), or reading them fails loudly. Fetching them does fail."""
    runner, x, step, mb = _runner_and_args()

    @tf.function(autograph=False)
    def forward():
        return runner.Forward(x, None, step, mb)

    @tf.function(autograph=False)
    def forward_and_gradients():
        return runner._trained(x, None, grad_lists.empty(), step, mb)

    @tf.function(autograph=False)
    def plain():
        return runner._forward(x, None, step, mb, True)

    np.testing.assert_array_equal(forward()[0], plain()[0])
    assert runner._trained.experimental_get_tracing_count() == 1
    with pytest.raises(tf.errors.InvalidArgumentError):
        forward_and_gradients()


def test_a_trace_under_a_paused_tape_is_not_shared_and_the_backward_stays_exact():
    """A forward traced under `executor.stop_recording` saw no tape: its trace is not used
    for gradients (they would be zeros); the backward then traces one of its own."""
    runner, x, step, mb = _runner_and_args()
    dy = (tf.ones([2, 3]),)

    @tf.function(autograph=False)
    def step_fn():
        with executor.stop_recording():
            y = runner.Forward(x, None, step, mb)
        d_x, d_vars = runner.Backward(x, None, dy, step, mb)
        return y, d_x, {v.name: g for v, g in d_vars}

    y, d_x, got = step_fn()
    assert list(runner._one_trace.values()) == [False]
    w, b = sorted(runner.cell.trainable_variables, key=lambda v: -v.shape.rank)
    with tf.GradientTape() as tape:
        tape.watch(x[0])
        want = runner.cell.FProp(x[0])
    want_x, want_w, want_b = tape.gradient(want, [x[0], w, b], output_gradients=dy[0])
    np.testing.assert_allclose(y[0], want, rtol=1e-6)
    np.testing.assert_allclose(d_x[0], want_x, rtol=1e-6)
    np.testing.assert_allclose(got[w.name], want_w, rtol=1e-6)
    np.testing.assert_allclose(got[b.name], want_b, rtol=1e-6)


def test_cells_that_write_state_eager_or_xla_cells_keep_a_trace_per_kind_of_call():
    bn = layers.BatchNormLayer.Params().Set(name='bn', dim=6)
    fc = layers.FCLayer.Params().Set(input_dim=6, output_dim=6)
    sub = [fc.Copy().Set(name='fc0'), bn, fc.Copy().Set(name='fc1'), fc.Copy().Set(name='fc2')]
    pipe = (
        gpipe.PipelinedLayer.Params()
        .Set(name='pipe', sub=sub, num_partitions=2, partition_by='uniform', num_micro_batches=2)
        .Instantiate()
    )
    x = tf.random.stateless_normal([4, 6], [1, 2])
    tf.function(lambda x: pipe.ComputeGradients(x, x, ttl._loss)).get_concrete_function(x)
    first, second = pipe._runners[0]
    # Batch norm accumulates its statistics in the forward (not in a recompute): no shared trace.
    assert not first.stateless and second.stateless
    assert first._trained.experimental_get_tracing_count() == 0
    assert first._forward.experimental_get_tracing_count() == 1
    assert first._backward.experimental_get_tracing_count() == 1

    runner, x, step, mb = _runner_and_args()
    assert not runner._MayShareTrace()  # eager: a call computes every output
    xla = recompute.CellRunner(runner.cell, None, 0, jit_compile=True)
    seen = []
    tf.function(lambda: seen.append(xla._MayShareTrace()), autograph=False)()
    assert seen == [False]  # XLA compiles every output of a call
