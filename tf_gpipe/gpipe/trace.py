"""Timestamps of every pipeline action, so a tool can draw one step as it really ran.

Inside `with trace.record() as events:` every PipelinedLayer built (traced) appends, per
action, an Event whose `start` and `end` are `tf.timestamp()` tensors on the cell's device.
Return them from the traced step to read the times. Outside `record()` nothing is added.

Where the stamps are taken matters. tf.function chains every stateful op that touches no
resource — `Timestamp` among them — in program order, across devices: a stamp in the step's
graph waits for the stamp before it, maybe for another device's work. So a cell call stamps
itself, inside its function (first op; and after its outputs), where that chain is the
call's own; only an action that is not a call (a kept forward, the gradient of a kept
forward) is stamped in the step's graph, when its inputs and outputs exist.
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


def note_stamps(start, end):
    """The (start, end) stamps taken inside the call that `end()` will record next."""
    _local.inner = (start, end)


def _tensors(structure):
    return [t for t in tf.nest.flatten(structure) if isinstance(t, tf.Tensor)]


def start(inputs):
    """A token for `end` (None when not recording): the action's inputs."""
    if getattr(_local, 'events', None) is None:
        return None
    _local.inner = None
    return (inputs,)


def end(token, phase, stage, micro_batch, outputs):
    """Records an Event for the action begun with `token` (no-op when not recording)."""
    events = getattr(_local, 'events', None)
    if events is None or token is None:
        return
    inner = getattr(_local, 'inner', None)
    _local.inner = None
    if inner is None:  # not a call: stamps when the inputs, then the outputs, exist
        with tf.control_dependencies(_tensors(token[0])):
            t_start = tf.timestamp()
        with tf.control_dependencies(_tensors(outputs)):
            t_end = tf.timestamp()
        inner = (t_start, t_end)
    events.append(Event(phase, stage, micro_batch, *inner))
