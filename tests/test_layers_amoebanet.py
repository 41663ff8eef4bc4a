"""AmoebaNet-D layers: shapes, FPropMeta against the built model, pipelined gradients."""

import numpy as np
import pytest
import tensorflow as tf

from tests import layer_testing
from tf_gpipe import gpipe, layers
from tf_gpipe.layers import amoebanet


@pytest.mark.parametrize('reduction,prev_is_larger', [(False, False), (True, False), (False, True)])
def test_cell_shapes_and_meta(reduction, prev_is_larger):
    p = amoebanet.AmoebaCell.Params().Set(
        name='c',
        filters=4,
        reduction=reduction,
        prev_channels=6,
        cur_channels=8,
        prev_is_larger=prev_is_larger,
    )
    prev = tf.random.normal([2, 16 if prev_is_larger else 8, 16 if prev_is_larger else 8, 6])
    cur = tf.random.normal([2, 8, 8, 8])
    out_cur, new = p.Instantiate().FProp(prev, cur)
    assert out_cur is cur
    size = 4 if reduction else 8
    assert new.shape == [2, size, size, amoebanet.AmoebaCell.OutChannels(p)]
    layer_testing.check_meta(p, prev, cur)


@pytest.mark.parametrize('stem', ['cifar', 'imagenet'])
def test_network_meta_equals_built_model(stem):
    sub = amoebanet.AmoebaNetLayers(3, 8, 10, stem=stem, stem_filters=4)
    stem_cells = ['stem_reduce0', 'stem_reduce1'] if stem == 'imagenet' else []
    names = ['stem', *stem_cells, 'cell00', 'reduce1', 'cell01', 'reduce2', 'cell02', 'head']
    assert [q.name for q in sub] == names
    seq = layers.SequentialLayer.Params().Set(name='net', sub=sub)
    meta = layer_testing.check_meta(seq, tf.random.normal([2, 32, 32, 3]))
    assert meta.out_shapes[0] == [2, 10]
    with pytest.raises(ValueError, match='multiple of 3'):
        amoebanet.AmoebaNetLayers(4, 8, 10)
    with pytest.raises(ValueError, match="stem must be one of .* got 'imagent'"):
        amoebanet.AmoebaNetLayers(3, 8, 10, stem='imagent')


def _param_count(num_cells, filters, image_size=224, num_classes=1000):
    seq = layers.SequentialLayer.Params().Set(
        name='net', sub=amoebanet.AmoebaNetLayers(num_cells, filters, num_classes, stem='imagenet')
    )
    return seq.cls.FPropMeta(seq, tf.TensorShape([1, image_size, image_size, 3])).param_count


@pytest.mark.parametrize(
    'num_cells,filters,paper', [(18, 208, 82e6), (18, 416, 318e6), (18, 544, 542e6)]
)
def test_parameter_counts_match_the_paper(num_cells, filters, paper):
    """Table 1 of the GPipe paper: AmoebaNet-D (L, D) sizes, counted without building."""
    assert abs(_param_count(num_cells, filters) / paper - 1) < 0.02


def test_imagenet_stem_runs_the_first_stack_at_an_eighth_of_the_image():
    sub = amoebanet.AmoebaNetLayers(3, 16, 10, stem='imagenet')
    shape = (tf.TensorShape([1, 224, 224, 3]),)
    sizes = {}
    for q in sub:
        shape = q.cls.FPropMeta(q, *shape).out_shapes
        sizes[q.name] = shape[-1][1]
    assert sizes == dict(
        stem=112, stem_reduce0=56, stem_reduce1=28, cell00=28, reduce1=14, cell01=14,
        reduce2=7, cell02=7, head=10,
    )  # fmt: skip


def test_cell_state_zero_is_the_latest_input():
    """The reference's wiring: state 0 is the processed latest input (first in the concat of a
    normal cell), state 1 the input before it."""
    p = amoebanet.AmoebaCell.Params().Set(name='c', filters=4, prev_channels=6, cur_channels=8)
    cell = p.Instantiate()
    prev, cur = tf.random.normal([2, 8, 8, 6]), tf.random.normal([2, 8, 8, 8])
    _, new = cell.FProp(prev, cur)
    np.testing.assert_allclose(new[..., :4], cell.pre_cur.FProp(cur), rtol=1e-6)


def test_bottleneck_convolutions():
    """3x3 and 1x7-7x1 narrow to a quarter of the channels, as in the reference."""
    op = amoebanet._op_params('op', 'conv_1x7_7x1', 64, 1)
    assert [tuple(f) for f in op.filter_shapes] == [
        (1, 1, 64, 16), (1, 7, 16, 16), (7, 1, 16, 16), (1, 1, 16, 64)
    ]  # fmt: skip
    op = amoebanet._op_params('op', 'conv_3x3', 64, 2)
    assert [tuple(f) for f in op.filter_shapes] == [(1, 1, 64, 16), (3, 3, 16, 16), (1, 1, 16, 64)]
    assert [tuple(s) for s in op.strides] == [(1, 1), (2, 2), (1, 1)]


def test_pipelined_amoebanet_gradients_equal_plain():
    sub = amoebanet.AmoebaNetLayers(3, 4, 5)
    x = tf.random.stateless_normal([4, 8, 8, 3], [1, 1])
    plain = layers.SequentialLayer.Params().Set(name='plain', sub=sub, random_seed=2).Instantiate()
    pipe = (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            sub=sub,
            num_partitions=3,
            partition_by='flops',
            input_shape=(4, 8, 8, 3),
            num_micro_batches=1,
            recompute='always',
            random_seed=2,
        )
        .Instantiate()
    )

    def grads(model):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model.FProp(x) * tf.random.stateless_normal([4, 5], [2, 2]))
        return loss, {
            v.name: g
            for v, g in zip(
                model.trainable_variables, tape.gradient(loss, model.trainable_variables)
            )
        }

    (l1, g1), (l2, g2) = tf.function(lambda: grads(pipe))(), grads(plain)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    scale = max(float(np.abs(g).max()) for g in g2.values())
    assert sorted(g1) == sorted(g2)
    for name, g in g2.items():
        np.testing.assert_allclose(g1[name], g, rtol=1e-4, atol=1e-5 * scale, err_msg=name)
