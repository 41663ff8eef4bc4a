"""The mode a forward pass runs in: training or eval, the step, and the micro-batch.

Layers read it instead of taking extra FProp arguments, so a pipeline can tell every layer of a
cell which micro-batch it processes (dropout masks depend on it) and whether this forward is a
recompute (batch norm must not count its statistics twice), without changing any layer's API.
"""

import contextlib
import dataclasses
import threading

_UNSET = object()


@dataclasses.dataclass(frozen=True)
class FPropContext:
    """What a forward pass needs to know beyond its inputs."""

    training: bool = True  # Lingvo's default: layers run in training mode unless told otherwise.
    step: object = None  # Global step (int or scalar int tensor); None: the layer's own counter.
    seed_offset: object = 0  # Distinguishes calls within one step (the pipeline's micro-batch).
    recompute: bool = False  # A backward-pass replay: same randomness, no statistics updates.

    def __getattribute__(self, name):
        if name == 'recompute':  # counted: see recompute_reads
            _local.recompute_reads = getattr(_local, 'recompute_reads', 0) + 1
        return object.__getattribute__(self, name)


_local = threading.local()


def current():
    """The innermost active context (a default one outside any `scope`)."""
    stack = getattr(_local, 'stack', None)
    return stack[-1] if stack else FPropContext()


@contextlib.contextmanager
def scope(training=_UNSET, step=_UNSET, seed_offset=_UNSET, recompute=_UNSET):
    """Runs the body with the given fields replaced; unspecified fields are inherited."""
    changes = {
        k: v
        for k, v in dict(
            training=training, step=step, seed_offset=seed_offset, recompute=recompute
        ).items()
        if v is not _UNSET
    }
    stack = getattr(_local, 'stack', None)
    if stack is None:
        stack = _local.stack = []
    reads = recompute_reads()
    stack.append(dataclasses.replace(current(), **changes))
    _local.recompute_reads = reads  # replace's own read is no layer's
    try:
        yield stack[-1]
    finally:
        stack.pop()


def recompute_reads():
    """How many times code on this thread has read a context's `recompute` (scope's own
    reads aside): a trace that did not read it computes the same with either value, which
    lets the pipeline call one trace for both (recompute.py)."""
    return getattr(_local, 'recompute_reads', 0)


def eval_mode():
    """Shorthand for `scope(training=False)`."""
    return scope(training=False)
