"""Checks that a Keras loss can be computed per micro-batch, on a few synthetic rows.

A per-micro-batch loss is the plain model's only when the batch's loss is the sum of the
micro-batches' shares (micro_loss). That holds for a mean or sum of per-example terms, and
fails silently for a loss that mixes examples (centring or normalising over the batch, a
batch-wide statistic). Nothing in a loss's code says which it is, so the loss is evaluated once,
eagerly, when the step is traced: on 5 synthetic rows, and on rows 0-1 and 2-4 alone. A batch
whose value is not the sum of its parts' shares is refused by name.
"""

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tf_gpipe.keras import micro_loss

ROWS, CUT = 5, 2  # uneven parts: a mean of the parts' means differs from the batch's mean
RTOL = 1e-4


class UnprobeableError(Exception):
    """No synthetic rows can be made for this loss's inputs (the log says why)."""


def check(loss_fn, kind, y_true, y_pred, what, schedule):
    """Raises a ValueError naming `what` when `mismatch` finds one."""
    found = mismatch(loss_fn, kind, y_true, y_pred, what)
    if found:
        raise ValueError(refusal(found, schedule))


def refusal(found, schedule):
    """The error for a `mismatch` under `schedule`."""
    return (
        f'{found}. schedule={schedule!r} computes the loss per micro-batch, so it would train '
        "another loss than the plain model's (a loss that mixes examples: centring or "
        "normalising over the batch, a batch statistic). Use schedule='gpipe' (the loss on the "
        'merged output), or a mean or sum of per-example terms.'
    )


def mismatch(loss_fn, kind, y_true, y_pred, what):
    """None when `loss_fn(y_true, y_pred, weights)` (a scalar) is the sum of its micro-batch
    shares under reduction `kind`, else a sentence naming `what` that says by how much.
    `y_true` and `y_pred` are nested structures of tensors (symbolic ones too) giving the
    dtypes and the inner shapes. A loss that cannot run on synthetic rows is not checked
    (logged)."""
    rng = np.random.RandomState(0)
    try:
        with tf.init_scope():
            rows = (
                tf.nest.map_structure(lambda t: _rows(t, rng), y_true),
                tf.nest.map_structure(lambda t: _rows(t, rng), y_pred),
                tf.constant(rng.uniform(0.5, 2.0, ROWS), tf.float32),
            )
            whole = _value(loss_fn, rows, slice(None))
            parts = [_value(loss_fn, rows, s) for s in (slice(0, CUT), slice(CUT, ROWS))]
    except UnprobeableError as e:
        logging.info('%s: not checked for a loss that mixes examples (%s).', what, e)
        return None
    except Exception as e:  # noqa: BLE001 - a user's loss may refuse synthetic rows
        logging.info(
            '%s: not checked for a loss that mixes examples: it fails on synthetic rows (%s: %s).',
            what,
            type(e).__name__,
            e,
        )
        return None
    weights = rows[2].numpy().astype(np.float64)
    sizes = np.array([CUT, ROWS - CUT], np.float64)
    if kind == micro_loss.SUM:
        share = np.ones(2)
    elif kind == micro_loss.WEIGHTED_MEAN:
        share = np.array([weights[:CUT].sum(), weights[CUT:].sum()]) / weights.sum()
    else:
        share = sizes / ROWS
    summed = float(np.dot(share, parts))
    if not np.isfinite(whole) or not np.isfinite(summed):
        logging.info('%s: not checked for a loss that mixes examples (not finite).', what)
        return None
    if abs(whole - summed) <= RTOL * (abs(whole) + np.dot(share, np.abs(parts)) + 1e-12):
        return None
    return (
        f'{what} is not a sum over examples: on {ROWS} synthetic rows it is {whole:.6g}, '
        f'but the shares of rows 0-{CUT - 1} and {CUT}-{ROWS - 1} computed alone add up to '
        f'{summed:.6g} (reduction {kind!r})'
    )


def _rows(spec, rng):
    """ROWS synthetic rows with spec's dtype and inner shape: integers in {0, 1} (valid class
    ids and binary targets), floats in (0.05, 0.95) (valid probabilities, logits, targets)."""
    if spec is None:
        return None
    shape = tf.TensorShape(spec.shape)
    if shape.rank is None or shape.rank == 0:
        raise UnprobeableError(f'a tensor of unknown rank or a scalar: {shape}')
    inner = tuple(2 if d is None else d for d in shape.as_list()[1:])
    dtype = tf.as_dtype(spec.dtype)
    if dtype.is_floating:
        value = rng.uniform(0.05, 0.95, (ROWS,) + inner)
    elif dtype.is_integer or dtype.is_bool:
        value = rng.randint(0, 2, (ROWS,) + inner)
    else:
        raise UnprobeableError(f'a tensor of dtype {dtype.name}')
    return tf.cast(tf.constant(value), dtype)


def _value(loss_fn, rows, part):
    y_true, y_pred, weights = tf.nest.map_structure(lambda t: None if t is None else t[part], rows)
    value = loss_fn(y_true, y_pred, weights)
    return float(np.asarray(keras.ops.convert_to_numpy(value), np.float64).sum())
