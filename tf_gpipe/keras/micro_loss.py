"""The compiled Keras loss of one micro-batch, as its share of the whole batch's loss.

Under 1F1B-like schedules a micro-batch's backward starts before the other micro-batches'
forwards end, so the compiled loss is computed per micro-batch. Keras reduces a loss over the
whole batch: its micro-batch share depends on the reduction. With n_m of the batch's N rows,
L_m the micro-batch's compiled loss (regularizers R included once) and W the sample weights:

    'sum_over_batch_size' / 'mean':          share = n_m/N * L_m
    'sum':                                   share = (L_m - R) + n_m/N * R
    'mean_with_sample_weight' with weights:  share = W_m/W * (L_m - R) + n_m/N * R

and the shares add up to the plain model's loss. Each share is also what the micro-batch's
backward starts from, so under mixed precision the cells see the loss scale times the share —
the magnitudes plain Keras sees — not times the micro-batch's size.
"""

import keras
import tensorflow as tf

MEAN = 'sum_over_batch_size'
SUM = 'sum'
WEIGHTED_MEAN = 'mean_with_sample_weight'
_MEANS = ('sum_over_batch_size', 'mean')


def reduction(model, schedule):
    """The one reduction of `model`'s compiled losses (MEAN, SUM or WEIGHTED_MEAN); a
    ValueError naming them when they differ or cannot be shared out per micro-batch."""
    found = {
        name: _kind(loss)
        for name, loss in compiled_losses(model.loss, getattr(model, 'output_names', None) or [])
    }
    kinds = set(found.values())
    if len(kinds) > 1:
        raise ValueError(
            f'The compiled losses mix reductions ({found}); schedule={schedule!r} computes the '
            f'loss per micro-batch and shares it out by one reduction. Give them one, or: {_FIX}'
        )
    return _checked(kinds.pop() if kinds else MEAN, schedule)


def reduction_of(loss, schedule):
    """The reduction of one Keras loss (as `reduction`)."""
    return _checked(_kind(loss), schedule)


_FIX = "Use schedule='gpipe' (the loss on the merged output, any reduction)."


def _kind(loss):
    kind = getattr(loss, 'reduction', MEAN)  # strings and functions: Keras's default
    return MEAN if kind in _MEANS else kind


def _checked(kind, schedule):
    if kind not in (MEAN, SUM, WEIGHTED_MEAN):
        raise ValueError(
            f'A loss has reduction={kind!r}; schedule={schedule!r} computes the loss per '
            "micro-batch and needs a scalar: 'sum_over_batch_size', 'sum' or "
            f"'mean_with_sample_weight'. {_FIX}"
        )
    return kind


def compiled_losses(loss, names):
    """(output name, loss) pairs of a compile() loss argument."""
    if isinstance(loss, dict):
        return [(k, v) for k, v in loss.items() if v is not None]
    if isinstance(loss, (list, tuple)):
        return [(names[i] if i < len(names) else str(i), v) for i, v in enumerate(loss)]
    return [] if loss is None else [('loss', loss)]


def outputs_with_loss(loss, names):
    """Indices of the outputs a compile() loss argument gives a loss (None: all of them)."""
    if isinstance(loss, dict):
        return [i for i, name in enumerate(names) if loss.get(name) is not None]
    if isinstance(loss, (list, tuple)) and len(loss) == len(names) > 1:
        return [i for i, one in enumerate(loss) if one is not None]
    return None


def regularization(model):
    """The model's additional losses (regularizers) as Keras's compute_loss adds them: summed,
    and under a tf.distribute strategy divided by its replicas (each replica adds its part)."""
    terms = [tf.reduce_sum(tf.cast(v, keras.config.floatx())) for v in model.losses]
    total = tf.add_n(terms) if terms else tf.constant(0.0, keras.config.floatx())
    return total / tf.cast(_replicas(), total.dtype)


def _replicas():
    return tf.distribute.get_strategy().num_replicas_in_sync


def share(kind, loss, regularizer, rows, total_rows, weights=None, total_weights=None, undo=1):
    """This micro-batch's share of this replica's part of the batch's loss (see the module
    doc). `loss` is its compiled loss L_m times `undo` (what undoes Keras's division of a mean
    by the replicas), `regularizer` what `regularization` says compute_loss added to it (only
    read for SUM and WEIGHTED_MEAN); `total_rows` and `total_weights` are the global batch's."""
    by_rows = tf.cast(rows / tf.maximum(total_rows, 1.0), loss.dtype)
    if kind == MEAN:
        return by_rows * loss
    if kind == SUM:
        part = tf.ones_like(by_rows)
    else:
        part = tf.cast(tf.math.divide_no_nan(weights, total_weights), loss.dtype)
    regularizer = tf.cast(regularizer, loss.dtype)
    in_loss = regularizer * undo  # the regularizer as it is inside `loss`
    whole = regularizer * tf.cast(_replicas(), loss.dtype)  # over all replicas' shares: once
    return part * (loss - in_loss) + by_rows * whole
