"""Zero-bubble's kept micro-batch as three calls cut from one trace (split_functions.py): the
cut is used, W holds only the weights' local gradient ops, and a forward whose state needs an
order falls back to an unsplit B (exactness of both is checked in test_executor.py)."""

import pytest
import tensorflow as tf

from tests.test_executor import CountingLayer
from tf_gpipe import gpipe, layers
from tf_gpipe.gpipe import split_functions


def _pipe(sub, policy='never', **kw):
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            sub=sub,
            num_partitions=2,
            partition_by='uniform',
            num_micro_batches=2,
            recompute=policy,
            schedule='zero_bubble',
        )
        .Set(**kw)
        .Instantiate()
    )


def _trace(pipe):
    x = tf.ones([4, 4])
    tf.function(
        lambda: pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y * y))
    ).get_concrete_function()


def _fc(name):
    return layers.FCLayer.Params().Set(name=name, input_dim=4, output_dim=4, activation='TANH')


def test_a_kept_cell_is_cut_into_f_b_w_and_w_is_local():
    pipe = _pipe([_fc(f'fc{i}') for i in range(6)])
    _trace(pipe)
    cut = [f for f in pipe._runners[0][0]._split.values()]
    assert len(cut) == 1 and isinstance(cut[0], split_functions.SplitFunctions)
    fns = cut[0]
    assert len(fns.split_variables) == 6  # 3 weights and 3 biases, each by local ops in W
    w_graph = fns.weights.get_concrete_function(
        tf.TensorSpec([], tf.int32), *[tf.TensorSpec.from_tensor(t) for t in fns._parts['w_feeds']]
    ).graph
    types = [op.type for op in w_graph.get_operations()]
    # One weight matmul per use, and none of the chain's gradient (tanh) in W.
    assert types.count('MatMul') <= 3 and 'TanhGrad' not in types, types


@pytest.mark.parametrize('cell_grappler', [False, True])
def test_state_written_and_not_read_is_cut_and_still_written_once_per_forward(cell_grappler):
    """Without Grappler too: B is fed a residual read whose op waits for the count's update,
    and must not hold that update (split_functions._prune)."""
    sub = [CountingLayer.Params().Set(name=f'c{i}') for i in range(2)]
    pipe = _pipe(sub, cell_grappler=cell_grappler)
    x = tf.ones([4, 2])
    tf.function(lambda: pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y)))()
    assert isinstance(list(pipe._runners[0][0]._split.values())[0], split_functions.SplitFunctions)
    assert [int(cell.sub[0].vars.count) for cell in pipe.cells] == [2, 2]  # M forwards each


class _ReadsItsCount(CountingLayer):
    """Adds to its count and reads it back in the same forward: the order of the two matters."""

    def FProp(self, x):
        return x * self.vars.scale + 0.0 * tf.cast(self.vars.count.assign_add(1), x.dtype)


def test_a_forward_that_reads_what_it_writes_falls_back_to_an_unsplit_b():
    sub = [_ReadsItsCount.Params().Set(name=f'c{i}') for i in range(2)]
    pipe = _pipe(sub)
    x = tf.ones([4, 2])
    loss, grads = tf.function(
        lambda: pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y))
    )()
    assert list(pipe._runners[0][0]._split.values()) == [None]
    assert float(loss) == 1.5 * 1.5 and [float(g) for g in grads] == [1.5, 1.5]
    assert [int(cell.sub[0].vars.count) for cell in pipe.cells] == [2, 2]


def test_residuals_are_the_micro_batch_s_activations_not_copies_of_the_weights():
    # F's residuals are what each kept micro-batch carries to its B and W. A weight as read
    # (or cast: bfloat16 layers cast their float32 weights in the forward) is the same for
    # every micro-batch, so B and W read it again instead of carrying a copy per micro-batch.
    for dtype in (tf.float32, tf.bfloat16):
        pipe = _pipe([_fc(f'fc{i}').Set(fprop_dtype=dtype) for i in range(6)])
        _trace(pipe)
        fns = list(pipe._runners[0][0]._split.values())[0]
        shapes = [t.shape.as_list() for t in fns.residuals if t.dtype.is_floating]
        # A micro-batch has 2 rows; a weight is 4 x 4 and a bias 4: no residual is either.
        assert shapes and all(s[:1] == [2] for s in shapes), (dtype, shapes)
