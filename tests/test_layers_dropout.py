"""DropoutLayer: rate, scaling, replayable masks, eval, gradients, FPropMeta."""

import numpy as np
import pytest
import tensorflow as tf

from tests import layer_testing
from tf_gpipe import fprop_context, layers


def _p(**kw):
    return layers.DropoutLayer.Params().Set(name='drop', keep_prob=0.75, random_seed=1, **kw)


def test_rate_and_scaling():
    layer = _p().Instantiate()
    with fprop_context.scope(step=0):
        y = layer.FProp(tf.ones([100, 100])).numpy()
    kept = y != 0
    assert 0.72 < kept.mean() < 0.78
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)


def test_mask_is_a_function_of_step_and_offset():
    layer = _p().Instantiate()
    x = tf.ones([50])

    def run(**ctx):
        with fprop_context.scope(**ctx):
            return layer.FProp(x).numpy()

    a = run(step=3, seed_offset=1)
    np.testing.assert_array_equal(a, run(step=3, seed_offset=1, recompute=True))
    assert not np.array_equal(a, run(step=4, seed_offset=1))
    assert not np.array_equal(a, run(step=3, seed_offset=2))
    # Same seed and name in a fresh layer: same mask. Another name: another mask.
    other = _p().Instantiate()
    with fprop_context.scope(step=3, seed_offset=1):
        np.testing.assert_array_equal(a, other.FProp(x).numpy())
        assert not np.array_equal(a, _p().Set(name='d2').Instantiate().FProp(x).numpy())


def test_without_step_counts_calls_and_recompute_replays():
    layer = _p().Instantiate()
    x = tf.ones([50])
    first = layer.FProp(x).numpy()
    with fprop_context.scope(recompute=True):
        np.testing.assert_array_equal(first, layer.FProp(x).numpy())
    assert not np.array_equal(first, layer.FProp(x).numpy())


def test_eval_and_keep_all_are_identity():
    x = tf.random.stateless_normal([10], [1, 1])
    with fprop_context.eval_mode():
        np.testing.assert_array_equal(_p().Instantiate().FProp(x), x)
    np.testing.assert_array_equal(_p().Set(keep_prob=1.0).Instantiate().FProp(x), x)


def test_gradient_is_the_mask():
    layer = _p().Instantiate()
    x = tf.random.stateless_normal([6, 7], [2, 2])
    with fprop_context.scope(step=1):
        mask = tf.cast(layer.Mask(tf.shape(x)), tf.float32)
        layer_testing.assert_same_grads(layer.FProp, lambda x: x * mask / 0.75, x, [])


def test_noise_shape_and_meta():
    layer = _p(noise_shape=[1, 5]).Instantiate()
    with fprop_context.scope(step=2):
        y = layer.FProp(tf.ones([4, 5])).numpy()
    assert (y == y[0]).all()  # one mask row broadcast
    layer_testing.check_meta(_p(), tf.ones([4, 5]))


def test_bad_keep_prob():
    with pytest.raises(ValueError, match='keep_prob must be in'):
        _p().Set(keep_prob=0.0).Instantiate()
