"""The private TF / Keras APIs the README lists: each import and its behaviour, so an upgrade
that moves or changes one fails here, by name, rather than somewhere deep in a pipeline."""

import pytest
import tensorflow as tf


def test_stop_recording_pauses_every_active_tape():
    from tensorflow.python.eager.record import stop_recording  # noqa: F401 - the pinned path

    from tf_gpipe.gpipe import executor

    x = tf.constant(2.0)
    with tf.GradientTape(persistent=True) as outer, tf.GradientTape() as inner:
        outer.watch(x)
        inner.watch(x)
        with executor._stop_recording():
            y = x * x
        z = x * 3.0
    assert outer.gradient(y, x) is None and inner.gradient(y, x) is None
    assert float(outer.gradient(z, x)) == 3.0


def test_keras_symbolic_scope_flag():
    from keras.src.backend.common.symbolic_scope import SymbolicScope, in_symbolic_scope

    assert not in_symbolic_scope()
    with SymbolicScope():
        assert in_symbolic_scope()


def test_keras_layer_internals_used_by_keras_state():
    """keras_state walks nested layers (`_flatten_layers`), replays `_seed_generators` (each a
    SeedGenerator whose `state` is [seed, counter]), and takes over BatchNormalization's
    training call using `_moments` and `_reduction_axes`, by setting `call` on the instance."""
    import keras
    import numpy as np

    inner = keras.layers.Dropout(0.5, seed=1)
    block = keras.Sequential([keras.layers.Dense(4), inner])
    assert inner in block._flatten_layers(include_self=True, recursive=True)
    (gen,) = inner._seed_generators
    assert isinstance(gen, keras.random.SeedGenerator) and tuple(gen.state.shape) == (2,)
    bn = keras.layers.BatchNormalization()
    x = tf.random.normal([6, 3, 5])
    bn.build(x.shape)
    assert list(bn._reduction_axes) == [0, 1]
    mean, variance = bn._moments(x, None)
    want_mean, want_variance = tf.nn.moments(x, [0, 1])
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(variance, want_variance, rtol=1e-5, atol=1e-6)
    bn.call = lambda inputs, training=None, mask=None: inputs * 0 + 7
    assert float(bn(x, training=True)[0, 0, 0]) == 7.0  # __call__ runs the instance's call


@pytest.mark.parametrize('kind', ['SGD', 'Adam'])
def test_keras_optimizer_hooks_placement_replaces(kind):
    """placement.colocated wraps `update_step`, `_apply_weight_decay`,
    `_clip_gradients` and `_all_reduce_sum_gradients` on the optimizer instance; apply_gradients
    must still call each of them."""
    import keras

    optimizer = getattr(keras.optimizers, kind)(0.1, weight_decay=0.01, global_clipnorm=1.0)
    names = ('update_step', '_apply_weight_decay', '_clip_gradients', '_all_reduce_sum_gradients')
    called = set()

    def recording(name, original):
        def hook(*args):
            called.add(name)
            return original(*args)

        return hook

    for name in names:
        setattr(optimizer, name, recording(name, getattr(optimizer, name)))
    optimizer.apply_gradients([(tf.constant([0.5, 0.5]), tf.Variable([1.0, 2.0]))])
    assert called == set(names)


def test_mirrored_strategy_takes_copy_devices_from_colocate_with():
    """distribute.stage_variables passes MirroredStrategy's variable creator an object whose
    `_devices` name the copies' devices (mirrored_strategy.py, MirroredExtended._create_variable):
    the only way to put cell k's copies on column k of the mesh."""
    import inspect

    from tensorflow.python.distribute import mirrored_strategy

    from tf_gpipe import cluster, distribute

    source = inspect.getsource(mirrored_strategy.MirroredExtended._create_variable)
    assert 'colocate_with._devices' in source
    mesh = cluster.DeviceMesh.from_local(num_replicas=2, num_stages=2)
    strategy = mesh.strategy()
    with strategy.scope(), distribute.stage_variables(mesh, 1):
        v = tf.Variable(1.0)
    got = [tf.DeviceSpec.from_string(c.device).device_index for c in v.values]
    assert got == [1, 3]
