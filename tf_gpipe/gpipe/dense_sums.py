"""A device's running sums of dense weight gradients, carried through a loop over ticks.

One TensorList per dtype holds one sum per variable: a single loop variable per dtype (each
loop variable costs ops at every tick), and one call adds a micro-batch's gradients to their
sums variable by variable, in place of the list's entries. The flat vector per dtype this
replaces had to concatenate every gradient first: one more copy of the cell's gradients per
backward, at the peak too (docs/results.md, the tick loop's peak memory table).
"""

import tensorflow as tf


class DenseSums:
    """Where each variable's sum sits: `pairs` is [(variable, gradient TensorSpec)]."""

    def __init__(self, pairs):
        groups = {}
        for v, sp in pairs:
            groups.setdefault(sp.dtype, []).append((v, sp))
        self.groups = list(groups.values())  # per dtype: [(variable, spec)]
        self._held = {v.ref() for v, _ in pairs}

    def __contains__(self, variable):
        return variable.ref() in self._held

    def New(self):
        """Zero sums, under the current device: one list per dtype."""
        return [
            _zeros(tuple(tuple(sp.shape.as_list()) for _, sp in g), g[0][1].dtype)
            for g in self.groups
        ]

    def Add(self, lists, pairs):
        """`lists` with the (variable, dense gradient) `pairs` added, those of the variables
        held here (a micro-batch's backward may reach only some)."""
        grads = {v.ref(): tf.convert_to_tensor(g) for v, g in pairs if v in self}
        lists = list(lists)
        for gi, group in enumerate(self.groups):
            at = tuple(vi for vi, (v, _) in enumerate(group) if v.ref() in grads)
            if at:
                present = [grads[group[vi][0].ref()] for vi in at]
                lists[gi] = _add(lists[gi], present, at, group[0][1].dtype)
        return lists

    def Read(self, lists):
        """[(variable, its sum)] out of `lists`."""
        out = []
        for handle, group in zip(lists, self.groups):
            for vi, (v, sp) in enumerate(group):
                out.append((v, tf.ensure_shape(_get(handle, vi, sp.dtype), sp.shape)))
        return out


def _get(handle, index, dtype):
    return tf.raw_ops.TensorListGetItem(
        input_handle=handle, index=index, element_shape=-1, element_dtype=dtype
    )


@tf.function(autograph=False, experimental_attributes={'_noinline': True})
def _zeros(shapes, dtype):
    handle = tf.raw_ops.TensorListReserve(
        element_shape=-1, num_elements=len(shapes), element_dtype=dtype
    )
    for i, shape in enumerate(shapes):
        handle = tf.raw_ops.TensorListSetItem(
            input_handle=handle, index=i, item=tf.zeros(shape, dtype)
        )
    return handle


@tf.function(autograph=False, experimental_attributes={'_noinline': True})
def _add(handle, grads, at, dtype):
    """One call per backward: each entry at `at` replaced by itself + its gradient."""
    for i, g in zip(at, grads):
        total = _get(handle, i, dtype) + tf.cast(g, dtype)
        handle = tf.raw_ops.TensorListSetItem(input_handle=handle, index=i, item=total)
    return handle
