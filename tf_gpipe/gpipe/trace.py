"""Timestamps of every pipeline action, so a tool can draw one step as it really ran.

Inside `with trace.record() as events:` every PipelinedLayer built (traced) appends, per
action, an Event whose `start` and `end` are `tf.timestamp()` tensors on the cell's device:
`start` once the action's inputs exist, `end` once its outputs do. Return them from the traced
step to read the times. Outside `record()` nothing is added.

Each action runs between its two stamps: its inputs pass on only after its start stamp, its
outputs only after its end stamp (`start` and `end` return them so). A stamp beside the program
is an op like any other, which a busy executor may run long after its inputs exist: in CI one
fired after the action that takes its action's result had ended, so the stamps contradicted
the data. As barriers they follow it by construction, at the price of two tiny calls per
action; the outputs are the same. Cells are `_noinline` calls that hand over all their outputs
together, so a consumer waits for no more work than before, only for the stamps.

One subtlety: tf.function chains every stateful op that touches no resource (`Timestamp` among
them) in program order, across devices, so a plain stamp would wait for the stamp before it,
maybe for another device's work. Each stamp is therefore a small function call that takes a
resource it only holds (a per-device anchor handle, never read or written): calls on a
read-only resource are not chained, so stamps follow the data alone.
"""

import collections
import contextlib
import threading

import tensorflow as tf

from tf_gpipe.gpipe.opaque import opaque

Event = collections.namedtuple('Event', ['phase', 'stage', 'micro_batch', 'start', 'end'])

_local = threading.local()
_anchors = {}  # device -> anchor variable


@contextlib.contextmanager
def record():
    """Collects the Events of the pipeline actions built in the body."""
    previous = getattr(_local, 'events', None)
    _local.events = events = []
    try:
        yield events
    finally:
        _local.events = previous


def recording():
    return getattr(_local, 'events', None) is not None


def _anchor(device):
    """A resource handle on `device` that is never read or written (no variable: creating one
    would make tf.function trace the step twice)."""
    if device not in _anchors:
        with tf.init_scope(), tf.device(device):
            _anchors[device] = tf.raw_ops.VarHandleOp(
                dtype=tf.int32, shape=[], shared_name=f'tf_gpipe_trace_anchor_{len(_anchors)}'
            )
    return _anchors[device]


@tf.function(autograph=False)
def _stamp(anchor, token):
    del anchor  # held, never used: see the module docstring
    with tf.control_dependencies([token]):
        return tf.timestamp()


def stamp_after(structure, device):
    """A timestamp taken on `device` once every tensor of `structure` exists."""
    tensors = [t for t in tf.nest.flatten(structure, expand_composites=True) if t is not None]
    with tf.device(device):
        with tf.control_dependencies([t for t in tensors if isinstance(t, tf.Tensor)]):
            token = opaque(tf.zeros([]))  # a constant would give each stamp its own function
        return _stamp(_anchor(device), token)


def after(structure, stamp):
    """`structure` passed through identities that wait for `stamp` (tensors only; anything
    else, None and composite tensors' non-tensor parts, as it is)."""

    def wait(t):
        return tf.identity(t) if isinstance(t, tf.Tensor) else t

    with tf.control_dependencies([stamp]):
        return tf.nest.map_structure(wait, structure, expand_composites=True)


def after_start(token, structure):
    """`structure` after the start stamp of `token` (as it is when `token` is None): for an
    action whose call takes none of the inputs `start` passed on."""
    return structure if token is None else after(structure, token[0])


def start(inputs, device):
    """(token for `end`, `inputs` to run the action on): the start stamp and the inputs,
    which then exist only after it. Not recording or in eager mode: (None, `inputs`)."""
    if not recording() or tf.executing_eagerly():
        return None, inputs
    stamp = stamp_after(inputs, device)
    return (stamp, device), after(inputs, stamp)


def end(token, phase, stage, micro_batch, outputs):
    """Records an Event for the action begun with `token` and returns `outputs`, which then
    exist only after its end stamp (as they are when not recording)."""
    events = getattr(_local, 'events', None)
    if events is None or token is None:
        return outputs
    t_start, device = token
    # After the start stamp too: an action may have no outputs that wait for it (W's instant).
    t_end = stamp_after((outputs, t_start), device)
    events.append(Event(phase, stage, micro_batch, t_start, t_end))
    return after(outputs, t_end)
