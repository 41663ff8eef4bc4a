"""GPipe(keras.Sequential): trains exactly like the plain model, with Keras' whole workflow."""

import logging
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.placement_testing import bulk_unplaced, misplaced_updates
from tf_gpipe.keras import GPipe, GPipeModel

X = np.random.RandomState(0).randn(64, 8).astype('float32')
Y = np.random.RandomState(1).randint(0, 3, 64)
W = np.random.RandomState(2).uniform(0.0, 2.0, 64).astype('float32')


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation='relu'),
            keras.layers.Dense(16, activation='tanh'),
            keras.layers.Dense(12, activation='relu'),
            keras.layers.Dense(12),
            keras.layers.Activation('relu'),
            keras.layers.Dense(3, activation='softmax'),
        ],
        name='mlp',
    )


def _optimizer(kind):
    if kind == 'sgd':
        return keras.optimizers.SGD(0.1, momentum=0.9)
    # Adam divides by sqrt(v) + epsilon: with the default 1e-7 a near-zero gradient's last-bit
    # summation noise becomes a full step; 1e-3 keeps the update Lipschitz in the gradient.
    return keras.optimizers.Adam(0.01, epsilon=1e-3)


def _compile(model, kind='sgd', **kw):
    kw.setdefault('loss', 'sparse_categorical_crossentropy')
    kw.setdefault('metrics', ['accuracy'])
    model.compile(optimizer=_optimizer(kind), **kw)
    return model


def _assert_same_weights(got, want):
    assert len(got.weights) == len(want.weights)
    for a, b in zip(got.weights, want.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=b.path)


def _assert_same_history(got, want):
    assert sorted(got.history) == sorted(want.history)
    for key, values in want.history.items():
        np.testing.assert_allclose(got.history[key], values, rtol=1e-5, err_msg=key)


@pytest.mark.parametrize('kind', ['sgd', 'adam'])
@pytest.mark.parametrize('k', [1, 2, 4])
@pytest.mark.parametrize('m', [1, 4])
def test_fit_equals_plain_sequential(kind, k, m):
    plain = _compile(_mlp(), kind)
    pipe = _compile(GPipe(_mlp(), num_partitions=k, num_micro_batches=m), kind)
    assert pipe.num_partitions == k and sum(pipe.balance) == 6
    fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    _assert_same_history(pipe.fit(X, Y, **fit), plain.fit(X, Y, **fit))
    _assert_same_weights(pipe, plain)
    np.testing.assert_allclose(
        pipe.evaluate(X, Y, batch_size=16, verbose=0),
        plain.evaluate(X, Y, batch_size=16, verbose=0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        pipe.predict(X, batch_size=32, verbose=0),
        plain.predict(X, batch_size=32, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_each_partition_on_its_device_with_its_optimizer_slots():
    pipe = _compile(GPipe(_mlp(), balance=[2, 1, 2, 1], num_micro_batches=2), 'adam')
    assert pipe.balance == [2, 1, 2, 1]
    devices = pipe.devices
    assert len(set(devices)) == 4
    owner = [0, 0, 1, 2, 2, 3]  # partition of each layer; the Activation has no weights
    for layer, k in zip(pipe.partition_layers, owner):
        for w in layer.weights:
            assert w.value.device.endswith(devices[k][-5:]), (layer.name, w.value.device)
    slots = [v for v in pipe.optimizer.variables if len(v.shape) > 0]
    assert len(slots) == 2 * len(pipe.trainable_weights)
    assert {v.value.device[-5:] for v in slots} == {d[-5:] for d in devices}
    table = pipe.partition_table()
    assert 'dense' in table and devices[3] in table


def test_train_step_updates_each_partition_on_its_device():
    pipe = _compile(GPipe(_mlp(), num_partitions=2, num_micro_batches=2), 'adam')
    x = tf.random.stateless_normal([8, 8], [1, 1])
    y = tf.constant([0, 1, 2, 0, 1, 2, 0, 1])
    graph = tf.function(lambda: pipe.train_step((x, y))).get_concrete_function().graph
    assert misplaced_updates(graph) == []
    assert bulk_unplaced(graph) == []


@pytest.mark.parametrize('reduction', ['sum_over_batch_size', 'sum', 'mean_with_sample_weight'])
def test_sample_weights_and_loss_reductions(reduction):
    loss = keras.losses.SparseCategoricalCrossentropy(reduction=reduction)
    kw = dict(loss=loss, weighted_metrics=['accuracy'], metrics=[])
    plain = _compile(_mlp(), **kw)
    pipe = _compile(GPipe(_mlp(), num_partitions=2, num_micro_batches=4), **kw)
    fit = dict(sample_weight=W, batch_size=32, epochs=2, shuffle=False, verbose=0)
    _assert_same_history(pipe.fit(X, Y, **fit), plain.fit(X, Y, **fit))
    _assert_same_weights(pipe, plain)


def test_weight_regularizers_count_in_the_loss():
    def model():
        keras.utils.set_random_seed(0)
        l2 = keras.regularizers.L2(0.05)
        return keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation='relu', kernel_regularizer=l2),
                keras.layers.Dense(3, activation='softmax', bias_regularizer=l2),
            ]
        )

    plain = _compile(model())
    pipe = _compile(GPipe(model(), num_partitions=2, num_micro_batches=2))
    fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    _assert_same_history(pipe.fit(X, Y, **fit), plain.fit(X, Y, **fit))
    _assert_same_weights(pipe, plain)


def test_a_loss_that_mixes_the_batch_is_exact():
    """The loss sees the merged batch, so even a loss across examples is the plain one."""

    def batch_centered_mse(y_true, y_pred):
        centered = y_pred - tf.reduce_mean(y_pred, axis=0, keepdims=True)
        return tf.reduce_mean(tf.square(centered - tf.one_hot(tf.cast(y_true, tf.int32), 3)), -1)

    plain = _compile(_mlp(), loss=batch_centered_mse, metrics=[])
    pipe = _compile(
        GPipe(_mlp(), num_partitions=2, num_micro_batches=4), loss=batch_centered_mse, metrics=[]
    )
    fit = dict(batch_size=32, epochs=2, shuffle=False, verbose=0)
    _assert_same_history(pipe.fit(X, Y, **fit), plain.fit(X, Y, **fit))
    _assert_same_weights(pipe, plain)


def _spied(pipe):
    """The pipeline entry points a fit step traces: ['ComputeGradients'] or ['FProp']."""
    calls = []
    inner = pipe.pipeline
    for name in ('ComputeGradients', 'FProp'):
        method = getattr(inner, name)

        def spy(*args, _name=name, _method=method, **kwargs):
            calls.append(_name)
            return _method(*args, **kwargs)

        object.__setattr__(inner, name, spy)
    return calls


def test_fit_under_gpipe_computes_the_loss_per_micro_batch_unless_it_cannot(caplog):
    """One training path: fit under 'gpipe' computes a shareable loss per micro-batch inside
    the pipeline (ComputeGradients), as every schedule does; a loss that mixes examples goes
    on the merged output (a tape over FProp), and the log says why."""
    pipe = _compile(GPipe(_mlp(), num_partitions=2, num_micro_batches=4))
    calls = _spied(pipe)
    pipe.fit(X, Y, batch_size=32, epochs=1, verbose=0)
    assert set(calls) == {'ComputeGradients'}

    def batch_centered_mse(y_true, y_pred):
        centered = y_pred - tf.reduce_mean(y_pred, axis=0, keepdims=True)
        return tf.reduce_mean(tf.square(centered - tf.one_hot(tf.cast(y_true, tf.int32), 3)), -1)

    pipe = _compile(
        GPipe(_mlp(), num_partitions=2, num_micro_batches=4), loss=batch_centered_mse, metrics=[]
    )
    calls = _spied(pipe)
    with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, 'absl'):
        pipe.fit(X, Y, batch_size=32, epochs=1, verbose=0)
    assert set(calls) == {'FProp'}
    assert (
        "fit under schedule='gpipe' computes the loss on the merged output, after the last "
        "forward, not per micro-batch: the compiled loss 'batch_centered_mse' is not a sum "
        'over examples'
    ) in caplog.text


def test_tf_data_input_and_a_partial_last_batch():
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    plain = _compile(_mlp())
    pipe = _compile(GPipe(_mlp(), num_partitions=2, num_micro_batches=4))
    fit = dict(epochs=2, shuffle=False, verbose=0)
    _assert_same_history(pipe.fit(data, **fit), plain.fit(data, **fit))
    _assert_same_weights(pipe, plain)
    ragged = tf.data.Dataset.from_tensor_slices((X[:62], Y[:62])).batch(16)  # last batch: 14
    _assert_same_history(pipe.fit(ragged, **fit), plain.fit(ragged, **fit))
    _assert_same_weights(pipe, plain)


def test_batches_that_m_does_not_divide_train_like_plain_keras():
    # Batches of 6 (and a last one of 4) with M=4; predict on 3 examples, fewer than M.
    plain = _compile(_mlp())
    pipe = _compile(GPipe(_mlp(), num_partitions=2, num_micro_batches=4))
    fit = dict(batch_size=6, epochs=1, shuffle=False, verbose=0)
    _assert_same_history(pipe.fit(X[:64], Y[:64], **fit), plain.fit(X[:64], Y[:64], **fit))
    _assert_same_weights(pipe, plain)
    np.testing.assert_allclose(
        pipe.predict(X[:3], verbose=0), plain.predict(X[:3], verbose=0), rtol=1e-5, atol=1e-6
    )


def _dropout_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation='relu'),
            keras.layers.Dropout(0.5, seed=1),
            keras.layers.Dense(32),
            keras.layers.Dropout(0.3, seed=2),
            keras.layers.Dense(3),
        ]
    )


def _loss_and_grads(model, x):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(Y[: len(x)], out, True)
            )
        return loss, tape.gradient(loss, model.trainable_variables), out

    return step()


def test_dropout_masks_are_replayed_in_recompute():
    """A recompute draws the forward's masks: every policy gives the same loss and gradients."""
    runs = {}
    for policy in ('always', 'except_last', 'never'):
        pipe = _compile(
            GPipe(_dropout_model(), num_partitions=2, num_micro_batches=4, recompute=policy)
        )
        runs[policy] = _loss_and_grads(pipe, X)
    loss, grads, _ = runs['never']  # 'never' differentiates the forward itself
    for policy in ('always', 'except_last'):
        np.testing.assert_allclose(runs[policy][0], loss, rtol=1e-6)
        for a, b in zip(runs[policy][1], grads):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_dropout_masks_differ_by_micro_batch_and_step_and_vanish_in_eval():
    pipe = _compile(GPipe(_dropout_model(), num_partitions=2, num_micro_batches=4))
    same = np.tile(X[:4], (4, 1))  # four identical micro-batches
    _, _, out = _loss_and_grads(pipe, same)
    outs = np.split(out.numpy(), 4)
    assert not np.allclose(outs[0], outs[1])
    _, _, again = _loss_and_grads(pipe, same)  # a training call outside fit: new masks,
    assert not np.allclose(again, out, atol=1e-3)  # as plain Keras's Dropout draws
    pipe.fit(same, Y[:16], batch_size=16, verbose=0)  # one optimizer step
    _, _, later = _loss_and_grads(pipe, same)
    assert not np.allclose(np.split(later.numpy(), 4)[0], outs[0], atol=1e-3)
    infer = pipe.predict(same, batch_size=16, verbose=0)
    np.testing.assert_allclose(infer[:4], infer[4:8], rtol=1e-6)


def _bn_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.Dense(16, activation='relu'),
            keras.layers.BatchNormalization(momentum=0.9, center=False),
            keras.layers.Dense(3, activation='softmax'),
        ]
    )


@pytest.mark.parametrize('recompute', ['always', 'never'])
def test_batch_norm_with_one_micro_batch_equals_plain(recompute):
    plain = _compile(_bn_model())
    pipe = _compile(GPipe(_bn_model(), num_partitions=2, num_micro_batches=1, recompute=recompute))
    fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    _assert_same_history(pipe.fit(X + 3.0, Y, **fit), plain.fit(X + 3.0, Y, **fit))
    _assert_same_weights(pipe, plain)  # moving statistics included


@pytest.mark.parametrize('recompute', ['always', 'except_last'])
def test_batch_norm_normalises_micro_batches_and_moves_averages_once_per_step(recompute):
    plain = _bn_model()
    pipe = _compile(GPipe(_bn_model(), num_partitions=2, num_micro_batches=4, recompute=recompute))
    x = X * 2.0 + 5.0
    # Training forward: each micro-batch normalised with its own statistics, as Keras would
    # normalise that micro-batch alone.
    _, _, out = _loss_and_grads(pipe, x)
    reference = keras.models.clone_model(plain)
    reference.set_weights(plain.get_weights())
    want = np.concatenate([reference(part, training=True) for part in np.split(x, 4)])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    for stats in pipe.pipeline.cells[0].AllLayers()[-1]._batch_norms:  # nothing applied yet
        assert float(stats.accumulators[0]) == 64.0
    pipe.pipeline.PostTrainingStepUpdate()
    # One update with the whole batch's statistics: the plain model's update on the batch.
    plain(x, training=True)
    bn_pipe, bn_plain = pipe.partition_layers[0], plain.layers[0]
    np.testing.assert_allclose(bn_pipe.moving_mean, bn_plain.moving_mean, rtol=1e-5)
    np.testing.assert_allclose(bn_pipe.moving_variance, bn_plain.moving_variance, rtol=1e-5)
    # Through fit(): after one step the first BN's averages match plain Keras on the full batch.
    plain2, pipe2 = _compile(_bn_model()), _compile(GPipe(_bn_model(), num_micro_batches=4))
    plain2.fit(x[:32], Y[:32], batch_size=32, verbose=0)
    pipe2.fit(x[:32], Y[:32], batch_size=32, verbose=0)
    for name in ('moving_mean', 'moving_variance'):
        np.testing.assert_allclose(
            getattr(pipe2.partition_layers[0], name),
            getattr(plain2.layers[0], name),
            rtol=1e-5,
            err_msg=name,
        )


def test_save_and_load_keras_format_and_weights(tmp_path):
    pipe = _compile(GPipe(_bn_model(), num_partitions=2, num_micro_batches=2), 'adam')
    pipe.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / 'model.keras')
    pipe.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, GPipeModel)
    assert loaded.balance == pipe.balance and loaded.devices == pipe.devices
    _assert_same_weights(loaded, pipe)
    assert int(loaded.optimizer.iterations) == int(pipe.optimizer.iterations) == 4
    # Training on from the file continues exactly like the original.
    fit = dict(batch_size=16, epochs=1, shuffle=False, verbose=0)
    _assert_same_history(loaded.fit(X, Y, **fit), pipe.fit(X, Y, **fit))
    _assert_same_weights(loaded, pipe)
    weights = str(tmp_path / 'model.weights.h5')
    pipe.save_weights(weights)
    fresh = GPipe(_bn_model(), num_partitions=2, num_micro_batches=2)
    fresh.load_weights(weights)
    _assert_same_weights(fresh, pipe)


def test_callbacks(tmp_path):
    pipe = _compile(GPipe(_mlp(), num_partitions=2, num_micro_batches=2))
    pipe.optimizer.learning_rate.assign(0.0)  # the loss cannot improve: early stopping fires
    callbacks = [
        keras.callbacks.TensorBoard(str(tmp_path / 'tb')),
        keras.callbacks.ModelCheckpoint(str(tmp_path / 'ckpt.keras')),
        keras.callbacks.EarlyStopping(monitor='loss', patience=1),
    ]
    history = pipe.fit(X, Y, batch_size=16, epochs=10, verbose=0, callbacks=callbacks)
    assert len(history.history['loss']) == 2
    events = [f for _, _, files in os.walk(tmp_path / 'tb') for f in files if 'tfevents' in f]
    assert events
    restored = keras.models.load_model(str(tmp_path / 'ckpt.keras'))
    _assert_same_weights(restored, pipe)


@pytest.fixture
def policy():
    yield keras.mixed_precision.set_global_policy
    keras.mixed_precision.set_global_policy('float32')


@pytest.mark.parametrize('name', ['mixed_bfloat16', 'mixed_float16'])
def test_mixed_precision(policy, name):
    policy(name)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation='relu'),
            keras.layers.Dense(16),
            keras.layers.Dense(3, activation='softmax', dtype='float32'),
        ]
    )
    pipe = _compile(GPipe(model, num_partitions=2, num_micro_batches=2))
    plain = _compile(model)
    assert pipe.partition_layers[0].compute_dtype == name.split('_')[1]
    assert all(w.dtype == 'float32' for w in pipe.weights)
    if name == 'mixed_float16':
        assert isinstance(pipe.optimizer, keras.optimizers.LossScaleOptimizer)
    fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    got, want = pipe.fit(X, Y, **fit), plain.fit(X, Y, **fit)
    # Low-precision sums over micro-batches round differently: close, not equal.
    np.testing.assert_allclose(got.history['loss'], want.history['loss'], rtol=2e-2)
    assert got.history['loss'][-1] < got.history['loss'][0]


def test_unbuilt_and_nested_sequentials():
    inner = keras.Sequential([keras.layers.Dense(16, activation='relu'), keras.layers.Dense(8)])
    model = keras.Sequential([inner, keras.layers.Dense(3)])
    pipe = GPipe(model, num_partitions=3, input_shape=(8,))
    assert [layer.name for layer in pipe.partition_layers] == [
        inner.layers[0].name,
        inner.layers[1].name,
        model.layers[1].name,
    ]
    assert not model.built  # the original never allocated weights
    assert pipe.predict(X, verbose=0).shape == (64, 3)


def test_partition_by_params_and_time():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(256), keras.layers.Dense(4), keras.layers.Dense(4)]
    )
    assert GPipe(model, num_partitions=2, partition_by='params').balance == [1, 2]
    assert sum(GPipe(model, num_partitions=2, partition_by='time').balance) == 3


def test_bad_input_errors():
    class Custom(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(TypeError, match='subclassed model'):
        GPipe(Custom())
    with pytest.raises(
        ValueError, match=r'num_partitions=7 is larger than the number of layers \(6\)'
    ):
        GPipe(_mlp(), num_partitions=7)
    with pytest.raises(ValueError, match='2 cells need 2 devices'):
        GPipe(_mlp(), num_partitions=2, devices=['/device:CPU:0'])
    with pytest.raises(ValueError, match='Unknown device'):
        GPipe(_mlp(), num_partitions=2, devices=['/device:CPU:0', '/device:CPU:9'])
    with pytest.raises(ValueError, match=r'balance=\[3, 2\] covers 5 layers; the model has 6'):
        GPipe(_mlp(), balance=[3, 2])
    with pytest.raises(ValueError, match='keras.Input'):
        GPipe(keras.Sequential([keras.layers.Dense(3)]))
    with pytest.raises(ValueError, match='recompute must be one of'):
        GPipe(_mlp(), recompute='sometimes')
    active = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activity_regularizer=keras.regularizers.L2())]
    )
    with pytest.raises(ValueError, match='activity_regularizer'):
        GPipe(active)
    with pytest.raises(ValueError, match=r'GPipe\(..., jit_compile=True\)'):
        GPipe(_mlp(), num_partitions=2).compile(optimizer='sgd', loss='mse', jit_compile=True)


def test_a_sequential_with_a_mask_carries_it_across_cells():
    """Embedding(mask_zero=True) in a Sequential: the mask reaches the pooling two cells later."""

    def model(mask_zero=True):
        keras.utils.set_random_seed(2)
        return keras.Sequential([
            keras.Input((6,), dtype='int32'),
            keras.layers.Embedding(10, 4, mask_zero=mask_zero),
            keras.layers.Dense(4, activation='tanh'),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ])  # fmt: skip

    ids = np.random.RandomState(0).randint(0, 10, (8, 6)).astype('int32')
    ids[:, 4:] = 0
    want = model().predict(ids, verbose=0)
    assert np.abs(model(mask_zero=False).predict(ids, verbose=0) - want).max() > 1e-4
    pipe = GPipe(model(), num_partitions=3, num_micro_batches=2)
    np.testing.assert_allclose(pipe.predict(ids, verbose=0), want, rtol=1e-5, atol=1e-6)


def _cnn():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((8, 8, 2)),
            keras.layers.Conv2D(4, 3, padding='same', activation='relu'),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(4, 3, activation='relu'),
            keras.layers.MaxPooling2D(2, padding='same'),
            keras.layers.Flatten(),
            keras.layers.Dense(3, activation='softmax'),
        ]
    )


def test_a_cnn_with_max_pooling_trains_as_plain_keras():
    """Max pooling's recomputing gradient (keras/state.py) in the front door, every
    micro-batch kept (its backward a function apart from its forward): plain Keras' history."""
    x = np.random.RandomState(3).randn(32, 8, 8, 2).astype('float32')
    plain = _compile(_cnn())
    pipe = _compile(GPipe(_cnn(), num_partitions=2, num_micro_batches=2, recompute='never'))
    fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    _assert_same_history(pipe.fit(x, Y[:32], **fit), plain.fit(x, Y[:32], **fit))
    _assert_same_weights(pipe, plain)


def _gradients(model, x, y, m=1):
    """Loss and {variable path: gradient}; the plain model is run micro-batch by micro-batch
    (batch norm normalises each micro-batch with its own statistics, as the pipeline does)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    with tf.GradientTape() as tape:
        if isinstance(model, GPipeModel):
            out = model(x, training=True)
        else:
            out = tf.concat([model(p, training=True) for p in tf.split(x, m)], 0)
        loss = loss_fn(y, out)
    grads = tape.gradient(loss, model.trainable_variables)
    return loss, {v.path: g for v, g in zip(model.trainable_variables, grads)}


@pytest.mark.parametrize('k', [4])  # K=2 ran too; 4 cuts deeper inside the backbone
def test_a_keras_model_inside_a_sequential_gets_every_gradient(k):
    """The transfer-learning stack: a keras.applications backbone inside a Sequential, cut at
    K=4 (the backbone's own graph is inlined and cut like the rest). Every one of its trainable
    variables gets the plain model's gradient (issue 12: 5 of 158 did). M=2: each of its 52
    batch norms normalises each micro-batch with its own statistics, as in the paper (the
    keras.applications micro-batch check; the whole batch's loss differs, so it can fail)."""

    def stack():
        keras.utils.set_random_seed(3)
        backbone = keras.applications.MobileNetV2(
            input_shape=(32, 32, 3), include_top=False, weights=None, alpha=0.35
        )
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                backbone,
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(3),
            ]
        )

    x = tf.random.stateless_normal([16, 32, 32, 3], [1, 2])
    y = tf.constant([0, 1, 2, 1] * 4)
    plain = stack()
    want_loss, want = tf.function(lambda: _gradients(plain, x, y, m=2))()
    whole = keras.losses.SparseCategoricalCrossentropy()(y, plain(x, training=True))
    assert abs(float(whole) - float(want_loss)) > 1e-4  # M matters here
    pipe = GPipe(stack(), num_partitions=k, num_micro_batches=2, recompute='always')
    assert len(pipe.trainable_variables) == len(plain.trainable_variables) == 158
    assert pipe.num_partitions == k and min(pipe.balance) > 1  # cut inside the backbone
    loss, got = tf.function(lambda: _gradients(pipe, x, y))()
    # 52 batch norms over 8-example micro-batches amplify float noise: the plain model alone
    # differs by 1.6e-5 (relative) between eager and tf.function. So 1e-4 here, not 1e-5.
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
    assert len(got) == len(want)  # the same variables, in the same order (names may differ)
    # Gradients that are zero in exact arithmetic (a batch norm's beta feeding another batch
    # norm) compare as noise: an absolute floor of 1e-4 x the largest gradient.
    scale = max(float(np.abs(w).max()) for w in want.values())
    for (path, g), w in zip(got.items(), want.values()):
        assert g is not None, path
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4 * scale, err_msg=path)


def test_a_layer_used_twice_stays_one_set_of_weights():
    keras.utils.set_random_seed(4)
    shared = keras.layers.Dense(8, activation='tanh')
    plain = keras.Sequential(
        [keras.Input((8,)), shared, keras.layers.Dense(8), shared, keras.layers.Dense(3)]
    )
    pipe = GPipe(plain, num_partitions=2, num_micro_batches=2)  # copies plain's weights
    assert len(pipe.trainable_variables) == len(plain.trainable_variables) == 6
    want_loss, want = _gradients(plain, X[:8], Y[:8])
    loss, got = _gradients(pipe, X[:8], Y[:8])
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for g, w in zip(got.values(), want.values()):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    'schedule,options',
    [
        ('1f1b', {}),
        ('zero_bubble', {}),
        ('interleaved_1f1b', {'virtual_stages': 2}),
        ('1f1b', {'tick_loop': True}),  # full batches by the tick loop, the last one unrolled
        ('gpipe', {'tick_loop': True}),  # FProp under a tape as two loops, any batch size
        ('1f1b', {'cell_grappler': True}),  # Grappler on the cells (off by default)
    ],
)
def test_every_schedule_trains_like_plain_keras(schedule, options):
    """The compiled loss per micro-batch on the last stage (with sample weights and a batch
    that M does not divide): history and weights equal plain Keras."""
    plain = _compile(_mlp(), 'adam')
    pipe = _compile(
        GPipe(_mlp(), num_partitions=2, num_micro_batches=4, schedule=schedule, **options),
        'adam',
    )
    assert pipe.pipeline.Schedule().name == schedule
    fit = dict(batch_size=12, epochs=2, shuffle=False, verbose=0, sample_weight=W)
    _assert_same_history(pipe.fit(X, Y, **fit), plain.fit(X, Y, **fit))
    _assert_same_weights(pipe, plain)


@pytest.mark.parametrize(
    'schedule,make',
    [
        ('gpipe', lambda: keras.optimizers.Adam(0.01)),
        ('1f1b', lambda: keras.optimizers.Adam(0.01)),
        # Keras's global norm squares a sparse gradient slice by slice (a repeated id's row
        # once per slice), then clips it made dense.
        ('gpipe', lambda: keras.optimizers.AdamW(0.01, global_clipnorm=0.05)),
        ('1f1b', lambda: keras.optimizers.AdamW(0.01, global_clipnorm=0.05)),
    ],
    ids=['gpipe', '1f1b', 'gpipe-clipnorm', '1f1b-clipnorm'],
)
def test_embedding_with_adam_matches_plain_keras(schedule, make):
    """Keras' Adam treats a sparse (IndexedSlices) gradient differently from a dense one when
    ids repeat; the pipeline hands it what plain Keras would: the same weights after training
    (Adam's default epsilon)."""

    def model():
        keras.utils.set_random_seed(5)
        return keras.Sequential(
            [
                keras.Input((4,), dtype='int32'),
                keras.layers.Embedding(20, 8),
                keras.layers.Flatten(),
                keras.layers.Dense(3),
            ]
        )

    ids = np.random.RandomState(3).randint(0, 6, (32, 4))  # ids 0..5: many repeats
    labels = np.random.RandomState(4).randint(0, 3, 32)
    plain, pipe = model(), GPipe(model(), num_partitions=2, num_micro_batches=4, schedule=schedule)
    for m in (plain, pipe):
        m.compile(make(), 'sparse_categorical_crossentropy')
        m.fit(ids, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
    _assert_same_weights(pipe, plain)


def test_keras_user_findings():
    """What a Keras user hit: a misspelt option, GPipe under a strategy not made by a mesh, an uncompiled
    model called in training mode, validation_split leaving batches M does not divide."""
    with pytest.raises(TypeError, match="unknown argument 'num_micro_batch' \\(did you mean "):
        GPipe(_mlp(), num_micro_batch=4)
    with pytest.raises(TypeError, match="'cell_graper' \\(did you mean 'cell_grappler'"):
        GPipe(_mlp(), cell_graper=True)
    strategy = tf.distribute.MirroredStrategy(['/device:CPU:0', '/device:CPU:1'])
    with strategy.scope():
        with pytest.raises(
            ValueError, match='MirroredStrategy that does not come from a DeviceMesh'
        ):
            GPipe(_mlp(), num_partitions=2)
    uncompiled = GPipe(_mlp(), num_partitions=2, num_micro_batches=2)
    plain = _mlp()
    np.testing.assert_allclose(
        uncompiled(X[:5], training=True), plain(X[:5], training=True), rtol=1e-5, atol=1e-6
    )
    # 64 examples, 20% for validation: 51 to train in batches of 8 (the last of 3), M=4.
    plain = _compile(_mlp())
    pipe = _compile(GPipe(_mlp(), num_partitions=2, num_micro_batches=4))
    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0, validation_split=0.2)
    _assert_same_history(pipe.fit(X, Y, **fit), plain.fit(X, Y, **fit))
    _assert_same_weights(pipe, plain)


class _Block(keras.layers.Layer):
    """A custom layer as plain Keras allows it: sublayers, no build(), no output shape."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.inner = keras.layers.Dense(units, activation='relu')
        self.outer = keras.layers.Dense(units)

    def call(self, x):
        return x + self.outer(self.inner(x))

    def get_config(self):
        return {**super().get_config(), 'units': self.units}


@pytest.mark.parametrize('partition_by', ['flops', 'uniform'])
def test_custom_layer_without_build_trains_like_plain_keras(partition_by):
    def model():
        keras.utils.set_random_seed(3)
        return keras.Sequential(
            [
                keras.Input((8,)),
                _Block(8, name='blk0'),
                _Block(8, name='blk1'),
                keras.layers.Dense(3),
            ]
        )

    plain = _compile(model())
    pipe = _compile(
        GPipe(model(), num_partitions=2, num_micro_batches=2, partition_by=partition_by)
    )
    assert len(pipe.trainable_variables) == len(plain.trainable_variables) == 10
    fit = dict(batch_size=16, epochs=1, shuffle=False, verbose=0)
    _assert_same_history(pipe.fit(X, Y, **fit), plain.fit(X, Y, **fit))
    _assert_same_weights(pipe, plain)
