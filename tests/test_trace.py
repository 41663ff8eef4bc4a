"""gpipe.trace: a timestamp pair per pipeline action, in an order the schedule allows, each
action between its pair; a recorded step computes what an unrecorded one does."""

import numpy as np
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


def _same(got, want):
    (loss, grads), (want_loss, want_grads) = got, want
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert len(grads) == len(want_grads)
    for g, w in zip(grads, want_grads):
        assert isinstance(g, tf.IndexedSlices) == isinstance(w, tf.IndexedSlices)
        np.testing.assert_allclose(tf.convert_to_tensor(g), tf.convert_to_tensor(w), rtol=1e-5)


def _recorded_and_not(step):
    want = tf.function(step)()
    with trace.record() as events:
        got = tf.function(step)()
    assert events
    return got, want


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'zero_bubble'])
def test_a_recorded_step_with_a_tied_embedding_computes_what_an_unrecorded_one_does(schedule):
    """The embedding's sparse gradients pass the stamps as they are (IndexedSlices), and its
    two uses' gradients still add up, under every policy."""
    from tests.test_ownership import _tied_lm

    ids = tf.random.stateless_uniform([8, 6], [1, 1], 0, 16, tf.int32)
    labels = tf.random.stateless_uniform([8, 6], [2, 2], 0, 16, tf.int32)
    for policy in gpipe.RECOMPUTE_POLICIES:
        pipe = (
            gpipe.PipelinedLayer.Params()
            .Set(name='pipe', sub=_tied_lm(), num_partitions=2, partition_by='uniform')
            .Set(num_micro_batches=4, schedule=schedule, recompute=policy, random_seed=5)
            .Instantiate()
        )
        softmax = pipe.cells[-1].sub[-1]

        def step(pipe=pipe, softmax=softmax):
            loss_fn = lambda logits, y: softmax.XentLoss(logits, y).avg_xent  # noqa: E731
            return pipe.ComputeGradients(ids, labels, loss_fn)

        _same(*_recorded_and_not(step))


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'zero_bubble'])
def test_a_recorded_step_of_two_replicas_computes_what_an_unrecorded_one_does(schedule):
    from tests import test_pipelined_layer as tpl

    sub, (x,) = tpl._fc_model()
    labels = tf.constant([0, 1, 2, 0, 1, 2, 0, 1])
    for policy in ('always', 'never'):
        pipe = tpl._replicated(sub, 2, 2, 2, policy, schedule=schedule)
        softmax = pipe.AllLayers()[-1]

        def step(pipe=pipe, softmax=softmax):
            loss_fn = lambda logits, y: softmax.XentLoss(logits, y).avg_xent  # noqa: E731
            return pipe.ComputeGradients(x, labels, loss_fn)

        _same(*_recorded_and_not(step))
