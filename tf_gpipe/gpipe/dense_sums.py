"""A device's running sums of dense weight gradients, carried through a loop over ticks.

One TensorList per dtype holds one sum per variable: a single loop variable per dtype (each
loop variable costs ops at every tick), and one call adds a micro-batch's gradients to their
sums variable by variable, in place of the list's entries. The flat vector per dtype this
replaces had to concatenate every gradient first: one more copy of the cell's gradients per
backward, at the peak too (docs/results.md, the tick loop's peak memory table).
"""

import tensorflow as tf

from tf_gpipe.gpipe import grappler


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
        """Zero sums, under the current device: one list per dtype. Its entries start unset,
        which a read takes as zeros of the entry's shape (TensorListGetItem): no zeros are
        built, and none held before a variable's first gradient."""
        return [
            tf.raw_ops.TensorListReserve(
                element_shape=-1, num_elements=len(g), element_dtype=g[0][1].dtype
            )
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
                shapes = tuple(tuple(group[vi][1].shape.as_list()) for vi in at)
                # Grappler has nothing to do in a chain of additions: off, as on the cells.
                with grappler.calls(False):
                    lists[gi] = _add(lists[gi], present, at, shapes, group[0][1].dtype)
        return lists

    def Read(self, lists):
        """[(variable, its sum)] out of `lists`: one call per list, not a read op (and its
        constants) per variable in the step's graph."""
        out = []
        for handle, group in zip(lists, self.groups):
            shapes = tuple(tuple(sp.shape.as_list()) for _, sp in group)
            with grappler.calls(False):
                sums = _get_all(handle, shapes, group[0][1].dtype)
            out += [(v, s) for (v, _), s in zip(group, sums)]
        return out


def _get(handle, index, shape, dtype):
    """Entry `index` (zeros of `shape` while unset), its static shape `shape`."""
    return tf.raw_ops.TensorListGetItem(
        input_handle=handle, index=index, element_shape=shape, element_dtype=dtype
    )


@tf.function(autograph=False, experimental_attributes={'_noinline': True})
def _get_all(handle, shapes, dtype):
    """Every entry of the list, each of its shape in `shapes`."""
    return [_get(handle, i, shape, dtype) for i, shape in enumerate(shapes)]


@tf.function(autograph=False, experimental_attributes={'_noinline': True})
def _add(handle, grads, at, shapes, dtype):
    """One call per backward: each entry at `at` replaced by itself + its gradient."""
    for i, g, shape in zip(at, grads, shapes):
        total = _get(handle, i, shape, dtype) + tf.cast(g, dtype)
        handle = tf.raw_ops.TensorListSetItem(input_handle=handle, index=i, item=total)
    return handle
