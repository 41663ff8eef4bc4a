"""The step's program does not grow with M beyond a constant per micro-batch, whatever L
(the unrolled executor, tick_loop=False), and not at all (the tick loop, tick_loop=True, and
the default, tick_loop=None, from loop_choice.AUTO_MIN_MICRO_BATCHES micro-batches on).

Counted, not timed: the nodes of a traced `ComputeGradients` step (outer graph; the function
library holds each cell's F, B and W once) at two M and two L, for every schedule and policy;
the same for eval's forward and gpipe's FProp under a tape, unrolled and as loops. A cell body
inlined per micro-batch (the engine before v3) adds nodes per micro-batch in proportion to the
layers, and fails here.
"""

import pytest
import tensorflow as tf

from tf_gpipe import fprop_context, gpipe, layers
from tf_gpipe.gpipe import loop_choice

K = 2


def _pipe(num_layers, m, schedule, policy, loop):
    fc = layers.FCLayer.Params().Set(input_dim=4, output_dim=4, activation='TANH')
    sub = [fc.Copy().Set(name=f'fc{i}') for i in range(num_layers)]
    v = 2 if schedule == 'interleaved_1f1b' else 1
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            sub=sub,
            num_partitions=K,
            partition_by='uniform',
            num_micro_batches=m,
            recompute=policy,
            schedule=schedule,
            virtual_stages=v,
            tick_loop=loop,
        )
        .Instantiate()
    )


def _nodes(num_layers, m, schedule, policy, loop):
    pipe = _pipe(num_layers, m, schedule, policy, loop)
    x = tf.ones([2 * m, 4])

    def step():
        return pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y * y))

    graph = tf.function(step).get_concrete_function().graph.as_graph_def()
    return len(graph.node)


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble'])
@pytest.mark.parametrize('policy', ['never', 'except_last', 'always'])
@pytest.mark.parametrize('loop', [False, True], ids=['unrolled', 'tick_loop'])
def test_nodes_per_micro_batch_do_not_depend_on_the_layers(schedule, policy, loop):
    few, many = 4, 12  # layers (per cell: 1 and 3 under interleaving, 2 and 6 otherwise)
    counts = {(n, m): _nodes(n, m, schedule, policy, loop) for n in (few, many) for m in (2, 4)}
    per_mb_few = (counts[few, 4] - counts[few, 2]) / 2
    per_mb_many = (counts[many, 4] - counts[many, 2]) / 2
    # Each action adds a call and a few ordering ops: a constant, the same for 4 and 12 layers.
    assert per_mb_many == per_mb_few, counts
    assert per_mb_few <= 40 * K, counts  # a small constant per micro-batch, not a cell body
    if loop:
        assert per_mb_few == 0, counts  # micro-batches are iterations


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble'])
def test_the_default_step_does_not_grow_from_auto_min_micro_batches_on(schedule):
    """tick_loop=None (the default) in one process: below AUTO_MIN_MICRO_BATCHES the unrolled
    step (a constant per micro-batch), from it on the loop, whose program is the same at any M."""
    a = loop_choice.AUTO_MIN_MICRO_BATCHES
    few, many = 4, 8
    counts = {
        (n, m): _nodes(n, m, schedule, 'except_last', None)
        for n in (few, many)
        for m in (a // 2, a, 2 * a)
    }
    for n in (few, many):
        assert counts[n, a] == counts[n, 2 * a], counts  # micro-batches are iterations
    # Below the threshold the unrolled executor's step, from it on the tick loop's.
    assert counts[few, a // 2] == _nodes(few, a // 2, schedule, 'except_last', False), counts
    assert counts[few, a] == _nodes(few, a, schedule, 'except_last', True), counts


def _call_nodes(num_layers, m, call, loop):
    fc = layers.FCLayer.Params().Set(input_dim=4, output_dim=4, activation='TANH')
    pipe = (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            sub=[fc.Copy().Set(name=f'fc{i}') for i in range(num_layers)],
            num_partitions=K,
            partition_by='uniform',
            num_micro_batches=m,
            recompute='always',
            tick_loop=loop,
            eval_loop=loop,
        )
        .Instantiate()
    )
    x = tf.ones([2 * m, 4])

    def step():
        if call == 'eval':
            with fprop_context.eval_mode():
                return pipe.FProp(x)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(pipe.FProp(x) ** 2)
        return tape.gradient(loss, pipe.trainable_variables)

    return len(tf.function(step).get_concrete_function().graph.as_graph_def().node)


@pytest.mark.parametrize('call', ['eval', 'fprop'])
@pytest.mark.parametrize('loop', [False, True], ids=['unrolled', 'loop'])
def test_eval_and_fprop_nodes_per_micro_batch_do_not_depend_on_the_layers(call, loop):
    few, many = 4, 12
    counts = {(n, m): _call_nodes(n, m, call, loop) for n in (few, many) for m in (2, 4)}
    per_mb_few = (counts[few, 4] - counts[few, 2]) / 2
    per_mb_many = (counts[many, 4] - counts[many, 2]) / 2
    assert per_mb_many == per_mb_few, counts
    assert per_mb_few <= 40 * K, counts
    if loop:
        assert per_mb_few == 0, counts  # micro-batches are iterations
