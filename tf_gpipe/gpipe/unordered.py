"""A loop body's per-device branch, called so that TF does not make the next tick wait for it.

Inside a tf.function, TF's automatic control dependencies make every output of a
`tf.while_loop` body wait for every stateful op of that body. A branch that calls a cell is
stateful (the cell reads variables), so each tick of a loop over devices ended with a barrier:
every device waited for the slowest action of the tick, and the loop ran the devices in
lockstep (docs/engine.md, "No tick waits for every device"; the steady step it cost is in
docs/results.md).

`branch(fn)` traces fn as a function of what it captures and returns a callable that makes one
`tf.raw_ops.PartitionedCall` of it: a call op TF does not count as stateful, so only data and
the loops' own control dependencies (each device's next action waits for its current one)
order it. What is inside still runs: the call's outputs are consumed, and the stateful ops of
the functions it calls are their control outputs. Ops sharing a resource are still ordered by
TF (automatic control dependencies look at resource inputs of every op).
`tests/test_unordered.py` pins both halves: the plain branch makes the barrier, this one not.
"""

import tensorflow as tf


def branch(fn, packer=None):
    """fn (no arguments; returns a nest of tensors and TensorArrays) as one stateless call;
    with a `packed_handles.HandlePacker`, its variable handles reach it packed."""
    kept = {}

    def flat():
        out = fn()
        kept['structure'] = out
        return [_flow(x) for x in tf.nest.flatten(out)]

    concrete = tf.function(flat, autograph=False).get_concrete_function()

    def call():
        captured = concrete.captured_inputs
        outputs = tf.raw_ops.PartitionedCall(
            args=packer.Args(captured) if packer else captured,
            Tout=[t.dtype for t in concrete.outputs],
            f=concrete,
        )
        for out, traced in zip(outputs, concrete.outputs):
            out.set_shape(traced.shape)
        leaves = tf.nest.flatten(kept['structure'])
        rebuilt = [_like(x, out) for x, out in zip(leaves, outputs)]
        return tf.nest.pack_sequence_as(kept['structure'], rebuilt)

    return call


def _flow(x):
    return x.flow if isinstance(x, tf.TensorArray) else x


def _like(x, out):
    """out as x was: a TensorArray rebuilt on its new flow (shapes not inferred, as every loop
    here makes its lists), a tensor as is."""
    if not isinstance(x, tf.TensorArray):
        return out
    return tf.TensorArray(
        x.dtype,
        size=None,
        flow=out,
        infer_shape=False,
        clear_after_read=False,
    )
