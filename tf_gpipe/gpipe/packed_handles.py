"""The variable handles a loop's branches call cells with, as one tensor per device.

A branch that calls a cell passes it the handle of every variable the cell reads. Inside a
`tf.while_loop` each such handle is a loop variable, and each `tf.switch_case` over a device's
branches routes it to the branch that runs: per tick and device, control-flow ops per variable,
and at the first call a graph (and its Grappler pass) that grows with the layers per cell.
`HandlePacker` stacks a branch's handles into one tensor per device, made in the graph where
the loop is built, and the branch unstacks it: the loop and its cases carry one tensor per
device instead.

The stack hides the handles from TF's automatic control dependencies, which order the ops of a
function that use one variable by the handles they take. The stack itself takes them (made
before the loop, it waits for earlier writes of those variables, and the loop waits for it),
and `Release` makes one more after the loop that waits for the loop: a later op that reads or
writes one of the variables waits for it, as it waited for the loop when the loop took the
handles itself (`tests/test_packed_handles.py`).
"""

import tensorflow as tf


class HandlePacker:
    """Packs branches' handles in the graph current at construction (the loop's)."""

    def __init__(self):
        self._graph = tf.compat.v1.get_default_graph()
        # (device, the handles' refs) -> (handles, their stack): F and B of a cell share one.
        self._stacks = {}

    def Args(self, captured):
        """A call's captured inputs with its variable handles (eager resource tensors, two or
        more on a device) replaced by slices of one stack per device, made in the loop's graph."""
        at = {}
        for i, c in enumerate(captured):
            if c.dtype == tf.resource and not tf.is_symbolic_tensor(c):
                at.setdefault(c.device, []).append(i)
        args = list(captured)
        for device, indices in at.items():
            if len(indices) < 2:
                continue
            handles = [captured[i] for i in indices]
            key = (device, tuple(h.ref() for h in handles))
            if key not in self._stacks:
                with self._graph.as_default(), tf.device(device):
                    self._stacks[key] = (handles, tf.stack(handles))
            packed = self._stacks[key][1]
            for i, h in zip(indices, tf.unstack(packed, num=len(indices))):
                args[i] = h
        return args

    def Release(self, after):
        """After the loop (`after`: its outputs): one stack per pack made waiting for them, so
        that later uses of the variables wait for the loop (automatic control dependencies)."""
        with tf.control_dependencies(after):
            for (device, _), (handles, _) in self._stacks.items():
                with tf.device(device):
                    tf.stack(handles)
