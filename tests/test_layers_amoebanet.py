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


def test_network_meta_equals_built_model():
    sub = amoebanet.AmoebaNetLayers(3, 8, 10)
    assert [q.name for q in sub] == [
        'stem',
        'cell00',
        'reduce1',
        'cell01',
        'reduce2',
        'cell02',
        'head',
    ]
    seq = layers.SequentialLayer.Params().Set(name='net', sub=sub)
    meta = layer_testing.check_meta(seq, tf.random.normal([2, 16, 16, 3]))
    assert meta.out_shapes[0] == [2, 10]
    with pytest.raises(ValueError, match='multiple of 3'):
        amoebanet.AmoebaNetLayers(4, 8, 10)


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
