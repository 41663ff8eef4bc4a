"""Replication and uneven batches: R replicas x M micro-batches draw what one pipeline with
R*M micro-batches draws; any batch size (30 or 5 with M=8) gives the full batch's loss and
gradients."""

import numpy as np
import pytest
import tensorflow as tf

from tests.test_pipelined_layer import _assert_close, _dropout_model, _fc_model, _plain
from tf_gpipe import fprop_context, gpipe


def _pipe(sub, k, m, r=1, schedule='gpipe', policy='always'):
    return (
        gpipe.PipelinedLayer.Params()
        .Set(name='pipe', sub=sub, num_partitions=k, partition_by='uniform')
        .Set(num_micro_batches=m, num_replicas=r, schedule=schedule, recompute=policy)
        .Set(random_seed=1)
        .Instantiate()
    )


def _loss_fn(y, t):
    return tf.reduce_mean(tf.reduce_sum(y * t, -1))


def _named(pipe, loss, grads, replica=0):
    variables = pipe._replica_variables[replica]
    by_ref = {v.ref(): g for v, g in zip(pipe.trainable_variables, grads)}
    return loss, [], {v.name: tf.convert_to_tensor(by_ref[v.ref()]) for v in variables}


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_r_replicas_draw_the_masks_of_one_pipeline_with_r_times_m(schedule):
    sub, (x,) = _dropout_model()
    t = tf.random.stateless_normal([8, 8], [3, 4])
    two = _pipe(sub, 2, 2, r=2, schedule=schedule)
    one = _pipe(sub, 2, 4, r=1, schedule=schedule)
    with fprop_context.scope(step=5):
        got = _named(two, *tf.function(lambda: two.ComputeGradients(x, t, _loss_fn))())
        want = _named(one, *one.ComputeGradients(x, t, _loss_fn))
        _assert_close(got, want)
        _assert_close(_named(two, *two.ComputeGradients(x, t, _loss_fn), replica=1), want)
        if schedule != 'gpipe':
            return
        # The replicas' rows really differ in their masks: the output of replica 1's rows
        # differs from what replica 0's masks would give them.
        with tf.GradientTape():
            y2, y1 = two.FProp(x), one.FProp(x)
        np.testing.assert_allclose(y2, y1, rtol=1e-6)
        same_masks = _pipe(sub, 2, 2, r=1)
        with tf.GradientTape():
            rows = same_masks.FProp(x[4:])
        assert not np.allclose(rows, y1[4:])


@pytest.mark.parametrize('n', [30, 5])
@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'zero_bubble'])
def test_any_batch_size_equals_the_full_batch(n, schedule):
    sub, _ = _fc_model()
    x = tf.random.stateless_normal([n, 8], [5, 6])
    t = tf.random.stateless_normal([n, 3], [6, 7])
    plain = _plain(sub)
    with tf.GradientTape() as tape:
        loss = _loss_fn(plain.FProp(x), t)
    grads = tape.gradient(loss, plain.trainable_variables)
    want = loss, [], {v.name: g for v, g in zip(plain.trainable_variables, grads)}
    for k, r in [(2, 1), (2, 2)]:
        pipe = _pipe(sub, k, 8, r=r, schedule=schedule, policy='except_last')
        _assert_close(_named(pipe, *pipe.ComputeGradients(x, t, _loss_fn)), want)
        if schedule == 'gpipe':  # and under a tape
            with tf.GradientTape() as tape:
                loss = _loss_fn(pipe.FProp(x), t)
            grads = tape.gradient(loss, pipe.trainable_variables)
            _assert_close(_named(pipe, loss, grads), want)
    with fprop_context.eval_mode():  # predict on a batch smaller than M
        np.testing.assert_allclose(pipe.FProp(x), plain.FProp(x), rtol=1e-5, atol=1e-6)


def test_unknown_batch_size_smaller_than_m():
    sub, _ = _fc_model()
    plain, pipe = _plain(sub), _pipe(sub, 2, 4)
    t = tf.random.stateless_normal([2, 3], [6, 7])
    step = tf.function(
        lambda x, t: pipe.ComputeGradients(x, t, _loss_fn),
        input_signature=[tf.TensorSpec([None, 8]), tf.TensorSpec([None, 3])],
    )
    x = tf.random.stateless_normal([2, 8], [5, 6])  # 2 examples, 4 micro-batches: 2 empty
    loss, grads = step(x, t)
    with tf.GradientTape() as tape:
        want = _loss_fn(plain.FProp(x), t)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for g, w in zip(grads, tape.gradient(want, plain.trainable_variables)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
