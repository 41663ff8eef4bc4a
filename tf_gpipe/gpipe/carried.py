"""A kept micro-batch's tensors carried across the tick loop's ticks (its residuals, from F to
B and W; under a split backward, what W reads of B's work).

They live in TensorArrays, one per dtype, with slots per micro-batch: the action that makes
them writes them, the last that reads them empties their slots, all inside the tick loop's
branches, so an idle tick only passes the lists on. A large tensor has a slot of its own (no
copy of it is ever made); the small ones are packed into one vector per dtype first, one
slot each: a slot costs a few ops per write and read, a pack a copy, and with many small
residuals (a Transformer cell has dozens per layer) slots everywhere made the loop's start-up
and steady step slower (measured with tools/startup.py, d=32), while packing large ones had
held a second copy of a micro-batch's activations at its forward (tools/peak_memory.py).
"""

import tensorflow as tf

from tf_gpipe.gpipe import call_op, grappler
from tf_gpipe.runtime import distribute

# Tensors of at least this many elements get a slot of their own (256 KiB of float32: the
# few ops of a slot cost about what copying that much does on a CPU core).
OWN_SLOT_ELEMENTS = 1 << 16


class Slots:
    """Where the tensors of `specs` (fully defined shapes) sit for each micro-batch."""

    def __init__(self, specs):
        self.specs = list(specs)
        self._own = [sp.shape.num_elements() >= OWN_SLOT_ELEMENTS for sp in self.specs]
        self._packing = Packing([sp for sp, own in zip(self.specs, self._own) if not own])
        # What is written per micro-batch: the large tensors, then the packed vectors.
        written = [sp for sp, own in zip(self.specs, self._own) if own] + self._packing.specs
        self._written = written
        self.dtypes = list(dict.fromkeys(sp.dtype for sp in written))
        self._counts = [0] * len(self.dtypes)
        self._where = []  # per written tensor: (its list, its slot within a micro-batch's)
        for sp in written:
            i = self.dtypes.index(sp.dtype)
            self._where.append((i, self._counts[i]))
            self._counts[i] += 1

    def New(self, num_m, device):
        """Empty lists for num_m micro-batches, on `device`."""
        with distribute.on(device):
            return [
                tf.TensorArray(dt, size=num_m * n, infer_shape=False, clear_after_read=False)
                for dt, n in zip(self.dtypes, self._counts)
            ]

    def Write(self, lists, m, tensors):
        """`lists` with micro-batch m's `tensors` (in the order of `specs`) written."""
        own = [t for t, o in zip(tensors, self._own) if o]
        packed = self._packing.Pack([t for t, o in zip(tensors, self._own) if not o])
        return self._Put(lists, m, own + packed)

    def Read(self, lists, m):
        """Micro-batch m's tensors, in the order of `specs`."""
        base = [lists[i].read(m * self._counts[i] + r) for i, r in self._where]
        base = [tf.ensure_shape(t, sp.shape) for t, sp in zip(base, self._written)]
        num_own = sum(self._own)
        own, small = iter(base[:num_own]), iter(self._packing.Unpack(base[num_own:]))
        return [next(own) if o else next(small) for o in self._own]

    def Free(self, lists, m):
        """`lists` with micro-batch m's slots emptied (after its last read)."""
        return self._Put(lists, m, [empty(sp) for sp in self._written])

    def _Put(self, lists, m, written):
        lists = list(lists)
        for (i, r), t in zip(self._where, written):
            lists[i] = lists[i].write(m * self._counts[i] + r, t)
        return lists


def empty(spec):
    """What stands for a tensor that is not there: no rows (a scalar: zero)."""
    if spec.shape.rank:
        return tf.zeros([0] + spec.shape.as_list()[1:], spec.dtype)
    return tf.zeros([], spec.dtype)


class Packing:
    """Tensors of fixed shapes as one flat vector per dtype (and back), each way one call.

    Each way is traced once per Packing and its trace called directly: a tf.function called
    with the layout as an argument spent more of the loop's trace building that argument's
    trace type than packing (tools/startup.py, zero bubble). Its calls run without Grappler,
    as the gradient sums' do."""

    def __init__(self, specs):
        self._in_specs = [tf.TensorSpec(sp.shape, sp.dtype) for sp in specs]
        self.layout = tuple((tuple(sp.shape.as_list()), sp.dtype) for sp in specs)
        self.dtypes = list(dict.fromkeys(sp.dtype for sp in specs))
        self.specs = [
            tf.TensorSpec([sum(sp.shape.num_elements() for sp in specs if sp.dtype == dt)], dt)
            for dt in self.dtypes
        ]
        self._traces = {}  # 'pack' / 'unpack' -> its trace

    def Pack(self, tensors):
        return self._Call('pack', _pack, self._in_specs, tensors)

    def Unpack(self, flats):
        return self._Call('unpack', _unpack, self.specs, flats)

    def _Call(self, way, body, specs, tensors):
        """body(tensors, layout, dtypes) through its trace for `specs`, made at the first call."""
        if not self.layout:
            return []
        if way not in self._traces:
            layout, dtypes = self.layout, tuple(self.dtypes)

            def traced(*ts):
                return body(ts, layout, dtypes)

            traced.__name__ = f'carried_{way}'
            self._traces[way] = call_op.trace(traced, *specs)
        # Reshapes, a concat and a split: Grappler's pass over them per device at the first
        # call (about 70 ms each at K=4, L=16 under zero-bubble, its log) would find nothing.
        with grappler.calls(False):
            return list(self._traces[way](*tensors))


def _pack(tensors, layout, dtypes):
    return [
        tf.concat([tf.reshape(t, [-1]) for t, (_, dt) in zip(tensors, layout) if dt == d], 0)
        for d in dtypes
    ]


def _unpack(flats, layout, dtypes):
    # One Split per dtype: a slice per tensor (strided_slice) costs the trace a millisecond or
    # more each, and a Transformer cell carries dozens of small residuals per layer.
    pieces = {}
    for d, flat in zip(dtypes, flats):
        sizes = [_size(shape) for shape, dt in layout if dt == d]
        pieces[d] = iter(tf.split(flat, sizes) if len(sizes) > 1 else [flat])
    return [tf.reshape(next(pieces[dt]), shape) for shape, dt in layout]


def _size(shape):
    size = 1
    for n in shape:
        size *= n
    return size
