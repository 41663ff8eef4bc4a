"""loss_probe: a loss computed per micro-batch must be the sum of its shares, or be refused."""

import logging

import keras
import pytest
import tensorflow as tf

from tf_gpipe.keras import loss_probe, micro_loss

LABELS = tf.TensorSpec([None], tf.int32)
PROBS = tf.TensorSpec([None, 3], tf.float32)
TARGETS = tf.TensorSpec([None, 3], tf.float32)


def _check(loss, kind, y_true=LABELS, y_pred=PROBS):
    weighted = kind == micro_loss.WEIGHTED_MEAN
    loss_probe.check(
        lambda t, p, w: loss(t, p, sample_weight=w if weighted else None),
        kind,
        y_true,
        y_pred,
        'the loss',
        '1f1b',
    )


class _Fn(keras.losses.Loss):
    def __init__(self, fn, reduction='sum_over_batch_size'):
        super().__init__(reduction=reduction)
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)


@pytest.mark.parametrize(
    'kind', [micro_loss.MEAN, micro_loss.SUM, micro_loss.WEIGHTED_MEAN], ids=str
)
def test_per_example_losses_pass_under_every_reduction(kind):
    _check(keras.losses.SparseCategoricalCrossentropy(reduction=kind), kind)
    _check(keras.losses.MeanSquaredError(reduction=kind), kind, TARGETS)
    _check(keras.losses.CategoricalCrossentropy(from_logits=True, reduction=kind), kind, TARGETS)


def test_a_function_returning_the_batch_mean_passes():
    """A scalar mean over the rows it is given: the micro-batches' shares add up to it."""
    _check(_Fn(lambda t, p: tf.reduce_mean(tf.square(t - p))), micro_loss.MEAN, TARGETS)


@pytest.mark.parametrize(
    'fn',
    [
        lambda t, p: tf.reduce_mean(tf.square(p - tf.reduce_mean(p, 0, keepdims=True) - t), -1),
        lambda t, p: tf.reduce_sum(tf.square(p - t), -1) / tf.reduce_sum(tf.square(p)),
        lambda t, p: tf.reduce_max(tf.reduce_sum(tf.square(p - t), -1)),
    ],
    ids=['centred-over-the-batch', 'normalised-by-the-batch', 'the-worst-example'],
)
@pytest.mark.parametrize('kind', [micro_loss.MEAN, micro_loss.SUM], ids=str)
def test_a_loss_that_mixes_examples_is_refused_by_name(fn, kind):
    with pytest.raises(ValueError, match=r"the loss is not a sum over examples.*schedule='gpipe'"):
        _check(_Fn(fn, reduction=kind), kind, TARGETS)


def test_a_mean_shared_as_a_sum_is_refused():
    """The check is of the share, not of the loss alone: a mean shared as a sum is wrong."""
    with pytest.raises(ValueError, match="reduction 'sum'"):
        _check(keras.losses.MeanSquaredError(), micro_loss.SUM, TARGETS)


def test_a_loss_that_cannot_run_on_synthetic_rows_is_logged_not_refused(caplog):
    def picky(t, p):
        tf.debugging.assert_greater(tf.reduce_min(p), 2.0, message='wants big predictions')
        return tf.reduce_mean(p, -1)

    with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, 'absl'):
        _check(_Fn(picky), micro_loss.MEAN, TARGETS)
        _check(_Fn(lambda t, p: p), micro_loss.MEAN, tf.TensorSpec(None, tf.float32))
    assert 'fails on synthetic rows (InvalidArgumentError' in caplog.text
    assert 'unknown rank' in caplog.text


def test_symbolic_specs_in_a_trace_are_probed_eagerly():
    """The step's trace gives symbolic tensors: the probe runs eagerly beside it, once."""
    calls = []

    def fn(t, p):
        calls.append(tf.executing_eagerly())
        return tf.reduce_mean(tf.square(p - tf.reduce_mean(p, 0, keepdims=True) - t), -1)

    @tf.function
    def step(t, p):
        _check(_Fn(fn), micro_loss.MEAN, t, p)
        return p

    with pytest.raises(ValueError, match='not a sum over examples'):
        step(tf.zeros([4, 3]), tf.zeros([4, 3]))
    assert calls == [True, True, True]
