"""The last cell's fused forward-and-backward standing for its recompute-backward
(recompute.py, `CellRunner._FusedFor`).

Under GPipe's fill-drain with 'except_last' the last cell runs its kept micro-batch as one fused
call and recomputes the others: the recompute-backward calls the fused trace (its outputs
dropped) instead of tracing the cell's forward and gradient a second time. Pinned here: no
backward of its own is traced then, unrolled and as a tick loop; the numbers are the plain
sequence's; a last cell whose forward writes a variable (batch norm's statistics) or reads the
recompute flag traces its own, since the fused call runs as the forward and the backward as a
replay; dropout (drawn from the step and the micro-batch) does neither and is shared.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe import fprop_context, gpipe, layers

K = 3  # cells 0 and 1 are twins (one shared backward); cell 2 holds the loss


class FlagReadingFC(layers.FCLayer):
    """An FC layer whose forward reads the recompute flag (and computes the same either way):
    nothing proves that a trace run as the forward computes what the replay would."""

    def FProp(self, inputs):
        out = super().FProp(inputs)
        return out * 1.0 if fprop_context.current().recompute else out


def _sub(last=None):
    fc = layers.FCLayer.Params().Set(input_dim=6, output_dim=6, activation='TANH')
    sub = [fc.Copy().Set(name=f'fc{i}') for i in range(2 * K)]
    if last == 'dropout':
        sub.insert(-1, layers.DropoutLayer.Params().Set(name='drop', keep_prob=0.7))
    elif last == 'batch_norm':
        sub.insert(-1, layers.BatchNormLayer.Params().Set(name='bn', dim=6))
    elif last == 'flag':
        sub[-1] = FlagReadingFC.Params().Set(
            name=f'fc{2 * K - 1}', input_dim=6, output_dim=6, activation='TANH'
        )
    return sub


def _pipe(sub, loop, policy='except_last'):
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            random_seed=1234,
            sub=sub,
            num_partitions=K,
            partition_by='uniform',
            num_micro_batches=4,
            recompute=policy,
            schedule='gpipe',
            tick_loop=loop,
        )
        .Instantiate()
    )


def _loss(y, t):
    return tf.reduce_mean(tf.reduce_sum((y - t) ** 2, -1))


def _data():
    return tf.random.stateless_normal([8, 6], [1, 2]), tf.random.stateless_normal([8, 6], [3, 4])


def _run(pipe):
    fn = tf.function(lambda x, t: pipe.ComputeGradients(x, t, _loss), autograph=False)
    loss, grads = fn(*_data())
    return fn, np.asarray(loss), [np.asarray(tf.convert_to_tensor(g)) for g in grads]


def _own_backwards(fn):
    """The cells' own recompute-backward functions in the step's library (not the twins'
    shared one, the fused call, or the backward TF derives for a kept forward)."""
    graph = fn.get_concrete_function(*_data()).graph.as_graph_def()
    names = [f.signature.name for f in graph.library.function]
    return [n for n in names if re.fullmatch(r'__inference__Backward_\d+', n)]


def _plain(sub, pipe):
    plain = layers.SequentialLayer.Params().Set(name='plain', sub=sub).Instantiate()
    for a, b in zip(plain.trainable_variables, pipe.trainable_variables, strict=True):
        a.assign(b)
    x, t = _data()
    with tf.GradientTape() as tape:
        loss = _loss(plain.FProp(x), t)
    grads = tape.gradient(loss, plain.trainable_variables)
    return np.asarray(loss), [np.asarray(g) for g in grads]


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert len(got[1]) == len(want[1])
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('loop', [False, True], ids=['unrolled', 'tick_loop'])
def test_the_last_cell_traces_its_forward_and_gradient_once(loop):
    sub = _sub()
    pipe = _pipe(sub, loop)
    fn, loss, grads = _run(pipe)
    assert _own_backwards(fn) == []
    _assert_same((loss, grads), _plain(sub, pipe))


@pytest.mark.parametrize('loop', [False, True], ids=['unrolled', 'tick_loop'])
def test_dropout_in_the_last_cell_is_replayed_by_the_fused_trace(loop):
    fn, loss, grads = _run(_pipe(_sub('dropout'), loop))
    assert _own_backwards(fn) == []
    # 'always' recomputes every micro-batch through a backward of the cell's own.
    want_fn, *want = _run(_pipe(_sub('dropout'), loop, 'always'))
    assert len(_own_backwards(want_fn)) == 1
    _assert_same((loss, grads), want)


@pytest.mark.parametrize('loop', [False, True], ids=['unrolled', 'tick_loop'])
@pytest.mark.parametrize('last', ['batch_norm', 'flag'])
def test_a_last_cell_that_writes_or_reads_the_flag_traces_its_own(last, loop):
    pipe = _pipe(_sub(last), loop)
    fn, loss, grads = _run(pipe)
    assert len(_own_backwards(fn)) == 1
    if last == 'flag':
        _assert_same((loss, grads), _plain(_sub(last), pipe))
    else:  # per micro-batch statistics: the plain sequence's differ; 'always' recomputes all
        _, *want = _run(_pipe(_sub(last), loop, 'always'))
        _assert_same((loss, grads), want)
