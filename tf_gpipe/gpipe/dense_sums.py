"""A device's running sums of dense weight gradients, carried through a loop over ticks.

One TensorList per dtype holds one sum per variable: a single loop variable per dtype (each
loop variable costs ops at every tick), and one call adds a micro-batch's gradients to their
sums variable by variable, in place of the list's entries. The flat vector per dtype this
replaces had to concatenate every gradient first: one more copy of the cell's gradients per
backward, at the peak too (docs/results.md, the tick loop's peak memory table).
"""

import tensorflow as tf

from tf_gpipe.gpipe import call_op, grappler


class DenseSums:
    """Where each variable's sum sits: `pairs` is [(variable, gradient TensorSpec)]."""

    def __init__(self, pairs):
        groups = {}
        for v, sp in pairs:
            groups.setdefault(sp.dtype, []).append((v, sp))
        self.groups = list(groups.values())  # per dtype: [(variable, spec)]
        self._held = {v.ref() for v, _ in pairs}
        self._shapes = [tuple(tuple(sp.shape.as_list()) for _, sp in g) for g in self.groups]

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
                shapes = tuple(self._shapes[gi][vi] for vi in at)
                key = ('add', at, shapes, group[0][1].dtype, tuple(g.dtype for g in present))
                if key not in _traces:
                    _traces[key] = _trace_add(lists[gi], present, at, shapes, group[0][1].dtype)
                # Grappler has nothing to do in a chain of additions: off, as on the cells.
                with grappler.calls(False):
                    lists[gi] = _traces[key](lists[gi], *present)
        return lists

    def Read(self, lists):
        """[(variable, its sum)] out of `lists`: one call per list, not a read op (and its
        constants) per variable in the step's graph."""
        out = []
        for gi, (handle, group) in enumerate(zip(lists, self.groups)):
            key = ('get_all', self._shapes[gi], group[0][1].dtype)
            if key not in _traces:
                _traces[key] = _trace_get_all(handle, self._shapes[gi], group[0][1].dtype)
            with grappler.calls(False):
                sums = _traces[key](handle)
            out += [(v, s) for (v, _), s in zip(group, sums)]
        return out


# Traces of _add and _get_all by what they compute (entries, shapes, dtypes), called directly:
# cells of the same layers share them, and asking a tf.function for its trace with the shapes
# as an argument had cost the tick loop's trace tens of milliseconds per call.
_traces = {}


def _trace_get_all(handle, shapes, dtype):
    """_get_all traced for `shapes`, a function of the list alone."""

    def _get_all_entries(h):
        return _get_all(h, shapes, dtype)

    return call_op.trace(_get_all_entries, handle)


def _trace_add(handle, grads, at, shapes, dtype):
    """_add traced for these entries, a function of the list and the gradients alone."""

    def _add_entries(h, *gs):
        return _add(h, gs, at, shapes, dtype)

    return call_op.trace(_add_entries, handle, *grads)


class _Constants:
    """The indices and shapes a traced body reads entries with: one Const of all indices
    (unstacked) and one per distinct shape, not two per entry (a cell has dozens of
    variables, and each constant is an op to build)."""

    def __init__(self, indices):
        values = tf.unstack(tf.constant(list(indices), tf.int32)) if indices else []
        self.index = dict(zip(indices, values))
        self._shapes = {}

    def shape(self, shape):
        if shape not in self._shapes:
            self._shapes[shape] = tf.constant(list(shape), tf.int32, shape=[len(shape)])
        return self._shapes[shape]


def _get(handle, index, shape, dtype, consts):
    """Entry `index` (zeros of `shape` while unset), its static shape `shape`."""
    out = tf.raw_ops.TensorListGetItem(
        input_handle=handle,
        index=consts.index[index],
        element_shape=consts.shape(shape),
        element_dtype=dtype,
    )
    out.set_shape(shape)
    return out


def _get_all(handle, shapes, dtype):
    """Every entry of the list, each of its shape in `shapes`."""
    consts = _Constants(range(len(shapes)))
    return [_get(handle, i, shape, dtype, consts) for i, shape in enumerate(shapes)]


def _add(handle, grads, at, shapes, dtype):
    """One call per backward: each entry at `at` replaced by itself + its gradient."""
    consts = _Constants(at)
    for i, g, shape in zip(at, grads, shapes):
        total = _get(handle, i, shape, dtype, consts) + tf.cast(g, dtype)
        handle = tf.raw_ops.TensorListSetItem(
            input_handle=handle, index=consts.index[i], item=total
        )
    return handle
