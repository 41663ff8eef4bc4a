"""gpipe.trace: a timestamp pair per pipeline action, in an order the schedule allows."""

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


def test_events_follow_the_data_dependencies():
    # Each action runs between its stamps (gpipe/trace.py), so the times follow the data by
    # construction, with no slack, however busy the machine: a stamp beside the program ran up
    # to tens of milliseconds late in CI (stage 1's B "starting" after stage 0's B had ended).
    pipe = _pipe(width=64)
    x = tf.random.stateless_normal([96, 64], [1, 2])
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
    for (phase, stage, m), (start, end) in times.items():
        assert start <= end
        if phase == 'F' and stage == 1:  # takes stage 0's output of the same micro-batch
            assert times[('F', 0, m)][1] <= start
        if phase == 'B' and stage == 0:  # takes stage 1's input gradient
            assert times[('B', 1, m)][1] <= start
        if phase == 'F' and m > 0:  # the device's previous action
            assert times[('F', stage, m - 1)][1] <= start
    assert times[('F', 1, 2)][1] <= times[('B', 1, 2)][0]


def test_nothing_is_recorded_outside_record():
    pipe = _pipe()
    with trace.record() as events:
        pass
    pipe.FProp(tf.zeros([6, 8]))
    assert events == []
