"""Grappler on the cells' functions: off by default (`cell_grappler=False`), to start faster.

TF runs Grappler, its graph optimizer, on a function's graph when a call first instantiates
the function, once per device that calls it, one after another along the schedule. At K=4,
M=32 that is the larger part of the pipeline's first call, and the cells' steady step is no
faster for it on CPU, nor their peak memory lower (docs/engine.md, "Start-up: cells without
Grappler"). A call op keeps the options it was created with (its `config_proto` attribute),
so a call created inside `calls(False)` instantiates its function without Grappler while the
user's step around it keeps it. Values are the same either way, up to float rounding
(Grappler rewrites a graph and may reorder its arithmetic).

The option lives in TF's context, so `calls` sets it for the few lines that create a call and
sets it back. Scopes nest (only the outermost one sets and restores it), and a program that
turned Grappler off itself, or asked it for mixed precision (which only Grappler applies),
is left as it is.
"""

import contextlib

import tensorflow as tf

_OFF = 'disable_meta_optimizer'
# Rewrites that change what a graph computes, not only how fast: cells keep them if asked for.
_NUMERICS = (
    'auto_mixed_precision',
    'auto_mixed_precision_onednn_bfloat16',
    'auto_mixed_precision_mkl',
)


def _asked_for_numerics(options):
    return any(options.get(k) for k in _NUMERICS)


def _left_as_is(optimize):
    """Whether to create calls with the program's own options: Grappler wanted on the cells,
    or the program turned it off itself or asked it for mixed precision. Reads TF's options
    only when Grappler is to be off (they are rebuilt on every read)."""
    if optimize:
        return True
    options = tf.config.optimizer.get_experimental_options()
    return bool(options.get(_OFF)) or _asked_for_numerics(options)


@contextlib.contextmanager
def calls(optimize):
    """Function calls created (or traced) inside instantiate without Grappler unless
    `optimize`."""
    if _left_as_is(optimize):
        yield
        return
    tf.config.optimizer.set_experimental_options({_OFF: True})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({_OFF: False})


def config_proto(optimize):
    """The `config_proto` attribute of a raw call op made like the ones `calls` creates:
    b'' (TF's defaults) or Grappler off."""
    if optimize or _asked_for_numerics(tf.config.optimizer.get_experimental_options()):
        return b''
    config = tf.compat.v1.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    return config.SerializeToString()


class Function:
    """A tf.function whose calls and traces are made inside `calls(optimize)`."""

    def __init__(self, function, optimize):
        self._function = function
        self._optimize = optimize

    def __call__(self, *args, **kwargs):
        with calls(self._optimize):
            return self._function(*args, **kwargs)

    def get_concrete_function(self, *args, **kwargs):
        with calls(self._optimize):
            return self._function.get_concrete_function(*args, **kwargs)
