"""Timestamps of every pipeline action, so a tool can draw one step as it really ran.

Inside `with trace.record() as events:` every PipelinedLayer built (traced) appends, per cell
call, an Event whose `start` and `end` are `tf.timestamp()` tensors on the cell's device. In a
traced graph the start is the first op inside the cell's function call (a stamp outside it,
waiting only for the call's inputs, can be starved of a thread until the call is over), the
end waits for the call's outputs. Return them from the traced step to read the times. Outside
`record()` nothing is added.
"""

import collections
import contextlib
import threading

import tensorflow as tf

Event = collections.namedtuple('Event', ['phase', 'stage', 'micro_batch', 'start', 'end'])

_local = threading.local()


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


def note_start(stamp):
    """The start stamp taken inside the call that `end` will record next (replaces start's)."""
    _local.inner_start = stamp


def _tensors(structure):
    return [t for t in tf.nest.flatten(structure) if isinstance(t, tf.Tensor)]


def start(inputs):
    """A timestamp taken when `inputs` exist (None when not recording)."""
    if getattr(_local, 'events', None) is None:
        return None
    _local.inner_start = None
    with tf.control_dependencies(_tensors(inputs)):
        return tf.timestamp()


def end(t_start, phase, stage, micro_batch, outputs):
    """Records an Event ending when `outputs` exist (no-op when not recording)."""
    events = getattr(_local, 'events', None)
    if events is None or t_start is None:
        return
    inner = getattr(_local, 'inner_start', None)
    _local.inner_start = None
    with tf.control_dependencies(_tensors(outputs)):
        events.append(
            Event(
                phase, stage, micro_batch, inner if inner is not None else t_start, tf.timestamp()
            )
        )
