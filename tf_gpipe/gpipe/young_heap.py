"""While the pipeline builds a step, Python's full garbage collections scan only what the
build allocated, not the whole heap that was there before it.

A trace allocates many objects that live on (ops, tensors, functions), so CPython runs full
(generation-2) collections during it, and each one walks every tracked object of the process:
the user's model, data and everything else (docs/engine.md, "Start-up: full collections
during the build", has what they cost, and what this does not save: the first full
collection after the build may come sooner than it would have).

`build()` freezes the heap at entry (`gc.freeze`: what exists is set aside, not collected
and not scanned) and gives it back at exit (`gc.unfreeze`), so garbage from before the build
is collected after it, not lost. Only graph building does it (an eager step builds nothing).
Scopes nest and may overlap across threads (a tf.distribute strategy builds each replica in a
thread of its own): the first to enter freezes, the last to leave gives back. A program that
froze objects itself, or turned the collector off, is left as it is.
"""

import contextlib
import gc
import threading

import tensorflow as tf

_lock = threading.Lock()
_depth = 0  # scopes open in the process
_froze = False  # whether the outermost scope froze the heap (so its exit gives it back)


@contextlib.contextmanager
def build():
    """The body builds graph: full collections inside scan only what it allocates."""
    if tf.executing_eagerly():
        yield
        return
    _enter()
    try:
        yield
    finally:
        _exit()


def _enter():
    global _depth, _froze
    with _lock:
        if _depth == 0:
            # Someone else's frozen objects: their own unfreeze is theirs to call, not ours.
            _froze = gc.isenabled() and gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
        _depth += 1


def _exit():
    global _depth, _froze
    with _lock:
        _depth -= 1
        if _depth == 0 and _froze:
            gc.unfreeze()
            _froze = False
