"""A cell's output gradients as one TensorList per float dtype.

A traced function needs the specs of its arguments before it is traced, and the specs of a
cell's output gradients are its outputs' specs: known only once the cell's forward has been
traced. Passed as lists, the gradients have a spec that does not depend on the outputs (one
variant scalar per float dtype), so a single trace of the cell can run its forward and then
read its output gradients (recompute.py, the cell's training trace). A list holds its entries
by reference: packing copies no gradient.
"""

import weakref

import tensorflow as tf

DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
SPECS = tuple(tf.TensorSpec([], tf.variant) for _ in DTYPES)


def _float(x):
    return isinstance(x, tf.Tensor | tf.TensorSpec) and x.dtype.is_floating


def supported(outputs):
    """Whether every float output's dtype has a list."""
    return all(x.dtype in DTYPES for x in tf.nest.flatten(outputs) if _float(x))


_EMPTY = weakref.WeakKeyDictionary()  # graph -> {key: the empty lists made there}


def _new_list(dt, num_elements):
    return tf.raw_ops.TensorListReserve(
        element_shape=-1, num_elements=num_elements, element_dtype=dt
    )


def empty(key=None):
    """Lists with no entries: the argument of a call whose gradients nobody reads. Made once
    per graph and `key` (the device they are made on) and shared by every call there, so a
    step's program grows by no op per such call."""
    made = _EMPTY.setdefault(tf.compat.v1.get_default_graph(), {})
    if key not in made:
        made[key] = tuple(_new_list(dt, 0) for dt in DTYPES)
    return made[key]


def pack(outputs, output_grads, key=None):
    """`output_grads` (the structure of `outputs`, traced tensors or specs; None where an output
    has no gradient) as the lists, or None when they cannot be: the structures differ, or a
    missing gradient's output has a shape not fully known (an unset entry reads as zeros of
    its output's shape). A dtype no output has gets `empty(key)`'s list."""
    flat_y, flat_dy = tf.nest.flatten(outputs), tf.nest.flatten(output_grads)
    if len(flat_y) != len(flat_dy):
        return None
    lists = []
    for dt in DTYPES:
        pairs = [(y, dy) for y, dy in zip(flat_y, flat_dy) if _float(y) and y.dtype == dt]
        if any(dy is None and not y.shape.is_fully_defined() for y, dy in pairs):
            return None
        if not pairs:
            lists.append(empty(key)[DTYPES.index(dt)])
            continue
        handle = _new_list(dt, len(pairs))
        for k, (_, dy) in enumerate(pairs):
            if dy is not None:
                item = tf.cast(dy, dt)
                handle = tf.raw_ops.TensorListSetItem(input_handle=handle, index=k, item=item)
        lists.append(handle)
    return tuple(lists)


def unpack(outputs, lists):
    """The gradients of `outputs` (tensors of the trace) out of `lists`, in their structure:
    None for an output that is not float."""
    taken = {dt: 0 for dt in DTYPES}
    grads = []
    for y in tf.nest.flatten(outputs):
        if not _float(y):
            grads.append(None)
            continue
        shape = y.shape
        element_shape = -1 if shape.rank is None else [-1 if d is None else d for d in shape]
        dy = tf.raw_ops.TensorListGetItem(
            input_handle=lists[DTYPES.index(y.dtype)],
            index=taken[y.dtype],
            element_shape=element_shape,
            element_dtype=y.dtype,
        )
        dy.set_shape(shape)
        taken[y.dtype] += 1
        grads.append(dy)
    return tf.nest.pack_sequence_as(outputs, grads)
