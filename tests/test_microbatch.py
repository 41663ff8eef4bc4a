"""Micro-batch split and merge: tensors, nested structures, other batch dims, errors."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe.gpipe import microbatch
from tf_gpipe.nested_map import NestedMap


def test_split_merge_round_trip_nested():
    x = NestedMap(vecs=tf.reshape(tf.range(24.0), [6, 4]), ids=tf.range(6), extra=(tf.ones([6]),))
    parts = microbatch.split(x, 3)
    assert len(parts) == 3 and isinstance(parts[0], NestedMap)
    np.testing.assert_array_equal(parts[1].ids, [2, 3])
    np.testing.assert_array_equal(parts[2].vecs, x.vecs[4:])
    merged = microbatch.merge(parts)
    for a, b in zip(tf.nest.flatten(merged), tf.nest.flatten(x)):
        np.testing.assert_array_equal(a, b)


def test_batch_dim_1():
    x = tf.reshape(tf.range(12), [2, 6])
    parts = microbatch.split(x, 2, batch_dim=1)
    np.testing.assert_array_equal(parts[0], [[0, 1, 2], [6, 7, 8]])
    np.testing.assert_array_equal(microbatch.merge(parts, batch_dim=1), x)


def test_not_divisible_names_batch_m_and_fix():
    with pytest.raises(
        ValueError, match=r'batch of 10 examples cannot be split into 4 .* e\.g\. 12'
    ):
        microbatch.split(tf.ones([10, 3]), 4)


def test_unknown_batch_size_is_checked_at_run_time():
    f = tf.function(lambda x: microbatch.split(x, 4)[0], input_signature=[tf.TensorSpec([None, 2])])
    assert f(tf.ones([8, 2])).shape == [2, 2]
    with pytest.raises(tf.errors.InvalidArgumentError, match='multiple of num_micro_batches=4'):
        f(tf.ones([6, 2]))


def test_input_without_batch_dim():
    with pytest.raises(ValueError, match='no batch dimension'):
        microbatch.split((tf.ones([4, 2]), tf.constant(1.0)), 2)
