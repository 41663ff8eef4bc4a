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


def test_any_batch_size_splits_into_pieces_differing_by_at_most_one():
    x = tf.reshape(tf.range(30), [30, 1])
    parts = microbatch.split(x, microbatch.num_pieces(30, 8))
    assert [int(p.shape[0]) for p in parts] == [4, 4, 4, 4, 4, 4, 3, 3]
    np.testing.assert_array_equal(microbatch.merge(parts), x)
    assert microbatch.num_pieces(5, 8) == 5  # fewer micro-batches than M for a small batch
    assert [int(p.shape[0]) for p in microbatch.split(tf.ones([5, 2]), 5)] == [1] * 5


def test_unknown_batch_size_splits_at_run_time():
    f = tf.function(
        lambda x: [tf.shape(p)[0] for p in microbatch.split(x, 4)],
        input_signature=[tf.TensorSpec([None, 2])],
    )
    assert [int(n) for n in f(tf.ones([8, 2]))] == [2, 2, 2, 2]
    assert [int(n) for n in f(tf.ones([6, 2]))] == [2, 2, 1, 1]
    assert [int(n) for n in f(tf.ones([2, 2]))] == [1, 1, 0, 0]  # empty pieces, no error


def test_inputs_that_disagree_on_the_batch():
    with pytest.raises(ValueError, match=r'disagree on the batch size .*\[4, 5\]'):
        microbatch.split((tf.ones([4, 2]), tf.ones([5, 2])), 2)


def test_input_without_batch_dim():
    with pytest.raises(ValueError, match='no batch dimension'):
        microbatch.split((tf.ones([4, 2]), tf.constant(1.0)), 2)
