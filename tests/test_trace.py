"""gpipe.trace: a timestamp pair per pipeline action, in an order the schedule allows."""

import pytest
import tensorflow as tf

from tf_gpipe import gpipe, layers
from tf_gpipe.gpipe import trace


def _pipe(width=8):
    sub = [
        layers.FCLayer.Params().Set(
            name=f'fc{i}', input_dim=width, output_dim=width, activation='TANH'
        )
        for i in range(4)
    ]
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            sub=sub,
            num_partitions=2,
            partition_by='uniform',
            num_micro_batches=3,
            devices=['/device:CPU:0', '/device:CPU:1'],
            random_seed=1,
        )
        .Instantiate()
    )


@pytest.mark.idle
def test_events_follow_the_data_dependencies():
    # Actions of tens of milliseconds each (1024-wide layers, 512 rows per micro-batch), so that
    # the order the data imposes is wider than any delay in running a ready stamp: with
    # 512-wide layers the tightest pair was 2.5-5 ms apart, and in CI one landed 3 ms the wrong way.
    pipe = _pipe(width=1024)
    x = tf.random.stateless_normal([1536, 1024], [1, 2])
    with trace.record() as events:

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(pipe.FProp(x))
            grads = tape.gradient(loss, pipe.trainable_variables)
            return grads, [tf.stack([e.start, e.end]) for e in events]

        _, stamps = step()
    assert [(e.phase, e.stage, e.micro_batch) for e in events] == [
        (a.phase, a.stage, a.micro_batch)
        for a in gpipe.schedules.execution_order(gpipe.schedules.build('gpipe', 2, 3))
    ]
    times = {(e.phase, e.stage, e.micro_batch): s.numpy() for e, s in zip(events, stamps)}
    # A stamp is taken once its tensors exist, by its own small op: two stamps waiting on
    # related tensors may fire in either order within the executor's scheduling latency.
    slack = 2e-3
    for (phase, stage, m), (start, end) in times.items():
        assert start <= end  # the end stamp also waits for the start stamp
        if phase == 'F' and stage == 1:  # needs stage 0's output of the same micro-batch
            assert times[('F', 0, m)][1] <= end + slack
        if phase == 'B' and stage == 0:  # starts from stage 1's input gradient (stage 1's
            # weight gradients may still be running on its device when stage 0's B ends)
            assert times[('B', 1, m)][0] <= end + slack
    assert times[('F', 1, 2)][1] <= times[('B', 1, 2)][1] + slack


def test_nothing_is_recorded_outside_record():
    pipe = _pipe()
    with trace.record() as events:
        pass
    pipe.FProp(tf.zeros([6, 8]))
    assert events == []
