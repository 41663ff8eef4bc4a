"""Timestamps of every pipeline action, so a tool can draw one step as it really ran.

Inside `with trace.record() as events:` every PipelinedLayer built (traced) appends, per cell
call, an Event whose `start` and `end` are `tf.timestamp()` tensors on the cell's device: the
start waits for the call's inputs (when the call becomes runnable), the end for its outputs.
Return them from the traced step to read the times. Outside `record()` nothing is added.
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


def _tensors(structure):
    return [t for t in tf.nest.flatten(structure) if isinstance(t, tf.Tensor)]


def start(inputs):
    """A timestamp taken when `inputs` exist (None when not recording)."""
    if getattr(_local, 'events', None) is None:
        return None
    with tf.control_dependencies(_tensors(inputs)):
        return tf.timestamp()


def end(t_start, phase, stage, micro_batch, outputs):
    """Records an Event ending when `outputs` exist (no-op when not recording)."""
    events = getattr(_local, 'events', None)
    if events is None or t_start is None:
        return
    with tf.control_dependencies(_tensors(outputs)):
        events.append(Event(phase, stage, micro_batch, t_start, tf.timestamp()))
