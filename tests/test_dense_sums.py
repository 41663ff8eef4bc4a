"""A device's running dense gradient sums (dense_sums.py): per variable, per dtype, added in
the order given, read back in each variable's shape (zeros for one no gradient reached);
variables not held are left alone."""

import numpy as np
import tensorflow as tf

from tf_gpipe.gpipe import dense_sums


def test_sums_per_variable_and_dtype_and_only_what_they_hold():
    a, b = tf.Variable(tf.zeros([2, 3])), tf.Variable(tf.zeros([4]))
    c = tf.Variable(tf.zeros([2], tf.float16))
    other, never = tf.Variable(tf.zeros([5])), tf.Variable(tf.ones([3, 1]))
    sums = dense_sums.DenseSums(
        [
            (a, tf.TensorSpec([2, 3])),
            (c, tf.TensorSpec([2], tf.float16)),
            (never, tf.TensorSpec([3, 1])),
            (b, tf.TensorSpec([4])),
        ]
    )
    assert len(sums.groups) == 2 and a in sums and other not in sums

    @tf.function(autograph=False)
    def run():
        lists = sums.New()
        lists = sums.Add(lists, [(a, tf.ones([2, 3])), (other, tf.ones([5]))])  # b, c absent
        lists = sums.Add(lists, [(b, tf.range(4.0)), (a, 2 * tf.ones([2, 3]))])
        lists = sums.Add(lists, [(c, tf.ones([2], tf.float16))])
        return [t for _, t in sums.Read(lists)]

    order = [v for g in sums.groups for v, _ in g]  # as Read returns them
    got = {v.ref(): t.numpy() for v, t in zip(order, run())}
    np.testing.assert_array_equal(got[a.ref()], np.full([2, 3], 3.0))
    np.testing.assert_array_equal(got[b.ref()], np.arange(4.0))
    assert got[c.ref()].dtype == np.float16 and got[c.ref()].tolist() == [1.0, 1.0]
    np.testing.assert_array_equal(got[never.ref()], np.zeros([3, 1]))
