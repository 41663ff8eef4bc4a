"""What a kept micro-batch carries across the tick loop's ticks (carried.py): each tensor comes
back as written, per micro-batch; large tensors have slots of their own, small ones travel
packed; a freed micro-batch's slots hold nothing."""

import numpy as np
import tensorflow as tf

from tf_gpipe.gpipe import carried


def _specs():
    big = carried.OWN_SLOT_ELEMENTS
    return [
        tf.TensorSpec([2, big // 2], tf.float32),  # a slot of its own
        tf.TensorSpec([2, 3], tf.float32),  # packed
        tf.TensorSpec([], tf.float32),  # packed
        tf.TensorSpec([2], tf.int32),  # packed, another dtype
        tf.TensorSpec([4, big // 4], tf.float32),  # a slot of its own
    ]


def _values(specs, m):
    return [
        tf.cast(tf.reshape(tf.range(sp.shape.num_elements()), sp.shape), sp.dtype) + 10 * m
        for sp in specs
    ]


def test_each_micro_batch_reads_back_what_it_wrote_and_large_tensors_are_not_packed():
    specs = _specs()
    slots = carried.Slots(specs)
    # Two large tensors alone, then one packed vector per dtype: 3 float32 slots, 1 int32.
    assert slots.dtypes == [tf.float32, tf.int32] and slots._counts == [3, 1]
    assert len(slots._packing.layout) == 3

    @tf.function(autograph=False)
    def run():
        lists = slots.New(3, None)
        for m in (2, 0):
            lists = slots.Write(lists, tf.constant(m), _values(specs, m))
        first = slots.Read(lists, tf.constant(2))
        lists = slots.Free(lists, tf.constant(2))
        freed = lists[0].read(2 * 3)  # micro-batch 2's first slot
        return first, slots.Read(lists, tf.constant(0)), freed

    at_2, at_0, freed = run()
    for got, want in zip(at_2, _values(specs, 2)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(at_0, _values(specs, 0)):
        np.testing.assert_array_equal(got, want)
    assert freed.shape[0] == 0


def test_packing_round_trips_and_makes_one_vector_per_dtype():
    specs = [s for s in _specs() if s.shape.num_elements() < carried.OWN_SLOT_ELEMENTS]
    packing = carried.Packing(specs)
    flats = packing.Pack(_values(specs, 1))
    assert [f.shape.as_list() for f in flats] == [[7], [2]]
    for got, want in zip(packing.Unpack(flats), _values(specs, 1)):
        np.testing.assert_array_equal(got, want)
