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


def test_sums_of_the_same_shapes_call_one_trace():
    """Cells of the same layers (twins) hold sums of the same shapes: their additions and
    reads call the same traced functions, one per distinct set of entries, not one per cell."""
    cells = [[tf.Variable(tf.zeros([2, 3])), tf.Variable(tf.zeros([3]))] for _ in range(3)]
    holders = [dense_sums.DenseSums([(v, tf.TensorSpec(v.shape)) for v in vs]) for vs in cells]

    @tf.function(autograph=False)
    def run():
        out = []
        for sums, (w, b) in zip(holders, cells):
            lists = sums.New()
            lists = sums.Add(lists, [(w, tf.ones([2, 3])), (b, tf.ones([3]))])
            lists = sums.Add(lists, [(w, tf.ones([2, 3]))])  # another set of entries
            out += [t for _, t in sums.Read(lists)]
        return out

    graph = run.get_concrete_function().graph
    called = [
        op.get_attr('f').name
        for op in graph.get_operations()
        if op.type in ('PartitionedCall', 'StatefulPartitionedCall')
    ]
    assert len(called) == 9 and len(set(called)) == 3, called
    got = [t.numpy() for t in run()]
    for w_sum, b_sum in zip(got[::2], got[1::2]):
        np.testing.assert_array_equal(w_sum, np.full([2, 3], 2.0))
        np.testing.assert_array_equal(b_sum, np.ones([3]))
