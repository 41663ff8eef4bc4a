"""Gradient ownership: a variable read by several cells gets the sum of every reader's
gradient, on its own device; sparse gradients stay sparse; a variable no cell owns is refused
by ComputeGradients by name and summed under FProp."""

import numpy as np
import pytest
import tensorflow as tf

from tests.test_pipelined_layer import _pipe
from tf_gpipe import base_layer, gpipe, layers
from tf_gpipe.gpipe import ownership


class ScaleLayer(base_layer.BaseLayer):
    """y = x * w; `w` is its own scalar, or another layer's when `tie_to` is set."""

    def __init__(self, params):
        super().__init__(params)
        self.CreateVariable('w', [], init=base_layer.WeightInit.Constant(2.0))
        self.tied = None

    def FProp(self, x):
        tied = self.tied() if callable(self.tied) else self.tied
        return x * (tied if tied is not None else self.vars.w)

    @classmethod
    def FPropMeta(cls, p, x):
        return base_layer.Meta(1, base_layer.to_shape(x), 1, 0)


def _scale_stack(k, schedule='gpipe', m=2):
    sub = [ScaleLayer.Params().Set(name=f's{i}') for i in range(4)]
    pipe = _pipe(sub, k, m, 'except_last', seed=None, schedule=schedule)
    layers_ = [layer for c in pipe.cells for layer in c.sub]
    layers_[3].tied = layers_[0].vars.w  # the last layer reads the first layer's scalar
    return pipe, layers_[0].vars.w


@pytest.mark.parametrize('k', [1, 2, 4])
@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'zero_bubble'])
def test_a_scalar_read_by_two_cells_gets_both_contributions(k, schedule):
    # y = x * w^2 * 2 * 2 (w = 2, other scalars 2): d sum(y) / dw = 2 * w * 4 * sum(x) = 48
    # for sum(x) = 3; an engine that keeps one reader's contribution gives 24.
    x = tf.constant([[1.0], [2.0]])
    pipe, w = _scale_stack(k, schedule)
    if schedule == 'gpipe':
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(pipe.FProp(x))
        got = tape.gradient(loss, w)
        np.testing.assert_allclose(got, 48.0)
    loss, grads = pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y))
    by_ref = {v.ref(): g for v, g in zip(pipe.trainable_variables, grads)}
    np.testing.assert_allclose(by_ref[w.ref()], 24.0)  # the mean over 2 examples: 48 / 2
    np.testing.assert_allclose(loss, 16.0 * 1.5)


def test_variable_owned_by_no_cell():
    outside = tf.Variable(3.0, name='outside')
    pipe, _ = _scale_stack(2)
    # Behind a closure, so that tf.Module's attribute walk does not adopt it into the pipeline.
    [layer for c in pipe.cells for layer in c.sub][2].tied = lambda: outside
    x = tf.constant([[1.0], [2.0]])
    with pytest.raises(ValueError, match="reads the trainable variable 'outside:0', which no cell"):
        pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y))
    with tf.GradientTape() as tape:  # under FProp its gradient is summed like any other
        loss = tf.reduce_sum(pipe.FProp(x))
    np.testing.assert_allclose(tape.gradient(loss, outside), 2 * 2 * 2 * 3.0)


def test_sparse_gradients_stay_sparse_and_equal_the_plain_ones():
    emb = layers.EmbeddingLayer.Params().Set(name='emb', vocab_size=10, embedding_dim=4)
    fc = layers.FCLayer.Params().Set(name='fc', input_dim=4, output_dim=4)
    ids = tf.constant([[1, 2], [1, 3], [2, 2], [9, 1]])  # repeated ids, across micro-batches
    plain = layers.SequentialLayer.Params().Set(name='p', sub=[emb, fc], random_seed=3)
    plain = plain.Instantiate()
    pipe = (
        gpipe.PipelinedLayer.Params()
        .Set(name='pipe', sub=[emb, fc], num_partitions=2, partition_by='uniform')
        .Set(num_micro_batches=4, schedule='1f1b', random_seed=3)
        .Instantiate()
    )

    def loss_fn(y, t):
        return tf.reduce_mean(tf.reduce_sum(y * y, [1, 2]))

    with tf.GradientTape() as tape:
        want_loss = loss_fn(plain.FProp(ids), None)
    want = tape.gradient(want_loss, plain.trainable_variables)
    loss, grads = pipe.ComputeGradients(ids, None, loss_fn)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    names = [v.name for v in pipe.trainable_variables]
    assert names == [v.name for v in plain.trainable_variables]
    for name, g, w in zip(names, grads, want):
        assert isinstance(g, tf.IndexedSlices) == isinstance(w, tf.IndexedSlices), name
        if isinstance(w, tf.IndexedSlices):  # the same rows, in the same order
            np.testing.assert_array_equal(g.indices, w.indices)
            np.testing.assert_allclose(g.values, w.values, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(
            tf.convert_to_tensor(g), tf.convert_to_tensor(w), rtol=1e-5, atol=1e-7
        )


def test_gradient_sums_on_the_variable_device():
    with tf.device('/device:CPU:1'):
        v = tf.Variable(tf.zeros([3, 2]))
    sums = ownership.GradientSums()
    with tf.device('/device:CPU:0'):
        sums.Add(v, tf.IndexedSlices(tf.ones([1, 2]), tf.constant([1]), tf.constant([3, 2])))
        sums.Add(v, tf.IndexedSlices(tf.ones([1, 2]), tf.constant([1]), tf.constant([3, 2])))
    total = sums.Total(v, scale=0.5)
    assert isinstance(total, tf.IndexedSlices) and total.values.device.endswith('CPU:1')
    np.testing.assert_allclose(tf.convert_to_tensor(total), [[0, 0], [1, 1], [0, 0]])
    sums.Add(v, tf.ones([3, 2]))  # a dense contribution makes the sum dense, as in TF
    np.testing.assert_allclose(sums.Total(v), [[1, 1], [3, 3], [1, 1]])
    assert sums.Total(tf.Variable(1.0)) is None


def _tied_lm(vocab=16, dim=8):
    tr = layers.TransformerLayer.Params().Set(
        input_dim=dim, num_heads=2, hidden_dim=16, causal=True
    )
    return [
        layers.EmbeddingLayer.Params().Set(name='emb', vocab_size=vocab, embedding_dim=dim),
        layers.PositionalEmbeddingLayer.Params().Set(name='pos', embedding_dim=dim),
        tr.Copy().Set(name='tr0'),
        tr.Copy().Set(name='tr1'),
        layers.LayerNorm.Params().Set(name='ln', input_dim=dim),
        layers.SoftmaxLayer.Params().Set(
            name='softmax', input_dim=dim, num_classes=vocab, tied_embedding='emb'
        ),
    ]


@pytest.mark.parametrize('k', [2, 4])
@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'zero_bubble'])
def test_tied_embedding_lm_equals_the_plain_sequence(k, schedule):
    """The embedding in cell 0, its tied softmax in cell K-1: one variable, the sum of both
    uses' gradients, equal to the plain sequence's (relative 1e-5)."""
    ids = tf.random.stateless_uniform([8, 6], [1, 1], 0, 16, tf.int32)
    labels = tf.random.stateless_uniform([8, 6], [2, 2], 0, 16, tf.int32)
    plain = layers.SequentialLayer.Params().Set(name='p', sub=_tied_lm(), random_seed=5)
    plain = plain.Instantiate()
    assert (
        len(plain.trainable_variables)
        == len(plain.sub[0].trainable_variables)
        + sum(len(x.trainable_variables) for x in plain.sub[1:5])
        + 1
    )  # the softmax has only its bias

    def loss_fn(logits, y):
        return plain.sub[-1].XentLoss(logits, y).avg_xent

    with tf.GradientTape() as tape:
        want_loss = loss_fn(plain.FProp(ids), labels)
    want = tape.gradient(want_loss, plain.trainable_variables)
    pipe = (
        gpipe.PipelinedLayer.Params()
        .Set(name='pipe', sub=_tied_lm(), num_partitions=k, partition_by='uniform')
        .Set(num_micro_batches=4, schedule=schedule, recompute='except_last', random_seed=5)
        .Instantiate()
    )
    emb = pipe.cells[0].sub[0].vars.emb
    assert pipe.cells[-1].sub[-1]._Weight is not None and emb.device.endswith('CPU:0')
    loss, grads = tf.function(lambda: pipe.ComputeGradients(ids, labels, loss_fn))()
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    got = {v.name: tf.convert_to_tensor(g) for v, g in zip(pipe.trainable_variables, grads)}
    want = {v.name: tf.convert_to_tensor(g) for v, g in zip(plain.trainable_variables, want)}
    assert sorted(got) == sorted(want) and 'emb/emb:0' in got
    scale = max(float(np.abs(g).max()) for g in want.values())
    for name, g in want.items():
        np.testing.assert_allclose(got[name], g, rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def test_tie_errors_name_the_problem():
    sub = _tied_lm()
    sub[-1] = sub[-1].Copy().Set(tied_embedding='embedding')
    seq = layers.SequentialLayer.Params().Set(name='p', sub=sub).Instantiate()
    with pytest.raises(ValueError, match="ties to the embedding 'embedding', which is not in"):
        seq.FProp(tf.zeros([2, 6], tf.int32))
    sub = _tied_lm()
    sub[-1] = sub[-1].Copy().Set(num_classes=12)
    with pytest.raises(ValueError, match='cannot tie to .emb. .vocab_size=16'):
        layers.SequentialLayer.Params().Set(name='p', sub=sub).Instantiate()
