"""grad_lists: a cell's output gradients as one TensorList per float dtype, read back in the
outputs' structure (an unset entry as zeros), refused where they cannot be packed."""

import numpy as np
import tensorflow as tf

from tf_gpipe.gpipe import grad_lists
from tf_gpipe.nested_map import NestedMap


def _outputs():
    return NestedMap(
        vecs=tf.ones([2, 3]),
        ids=tf.ones([2], tf.int32),
        wide=tf.ones([2, 2], tf.float64),
        half=tf.ones([4], tf.bfloat16),
        other=tf.ones([2, 3]),
    )


def test_pack_then_unpack_gives_each_gradient_back_in_its_dtype_and_place():
    outputs = _outputs()
    grads = NestedMap(
        vecs=tf.reshape(tf.range(6, dtype=tf.float32), [2, 3]),
        ids=None,
        wide=tf.constant([[1.0, 2.0], [3.0, 4.0]], tf.float64),
        half=tf.constant([1.0, 2.0, 3.0, 4.0], tf.float32),  # cast to the output's dtype
        other=None,  # no gradient: read as zeros of the output's shape
    )

    @tf.function(autograph=False)
    def roundtrip():
        lists = grad_lists.pack(outputs, grads)
        return grad_lists.unpack(outputs, lists)

    got = roundtrip()
    assert got.ids is None
    np.testing.assert_array_equal(got.vecs, grads.vecs)
    np.testing.assert_array_equal(got.wide, grads.wide)
    assert got.half.dtype == tf.bfloat16
    np.testing.assert_array_equal(tf.cast(got.half, tf.float32), grads.half)
    np.testing.assert_array_equal(got.other, np.zeros([2, 3], np.float32))


def test_specs_do_not_depend_on_the_outputs():
    lists = grad_lists.pack(_outputs(), tf.nest.map_structure(lambda _: None, _outputs()))
    assert [tf.TensorSpec.from_tensor(t) for t in lists] == list(grad_lists.SPECS)
    assert [tf.TensorSpec.from_tensor(t) for t in grad_lists.empty()] == list(grad_lists.SPECS)


def test_what_cannot_be_packed_is_refused():
    outputs = _outputs()
    fewer = NestedMap(vecs=None)
    assert grad_lists.pack(outputs, fewer) is None  # not the outputs' structure
    unknown = tf.TensorSpec([None, 3], tf.float32)
    assert grad_lists.pack([unknown], [None]) is None  # zeros of an unknown shape
    assert grad_lists.pack([unknown], [tf.ones([2, 3])]) is not None
    assert grad_lists.supported(outputs)
    assert not grad_lists.supported([tf.TensorSpec([2], tf.dtypes.experimental.float8_e4m3fn)])
