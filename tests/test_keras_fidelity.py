"""The pipelined Keras model is the original model: state, names, outputs and randomness as in
plain Keras, or a clear refusal at construction (issue 27)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.standalone import run_without_tf_gpipe
from tf_gpipe.keras import GPipe

X = np.random.RandomState(0).randn(32, 8).astype('float32')


def _assert_close(got, want, rtol=1e-5, atol=1e-6):
    for a, b in zip(keras.tree.flatten(got), keras.tree.flatten(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def test_an_adapted_normalization_predicts_as_the_original(tmp_path):
    keras.utils.set_random_seed(0)
    norm = keras.layers.Normalization()
    norm.adapt(X * 3.0 + 1.0)
    plain = keras.Sequential([keras.Input((8,)), norm, keras.layers.Dense(4)])
    pipe = GPipe(plain, num_partitions=2)
    want = plain.predict(X, verbose=0)
    _assert_close(pipe.predict(X, verbose=0), want)
    path = str(tmp_path / 'norm.keras')
    pipe.save(path)  # the same model before and after saving
    _assert_close(keras.models.load_model(path).predict(X, verbose=0), want)


@keras.saving.register_keras_serializable(package='test_keras_fidelity')
class _Scale(keras.layers.Layer):
    """A custom layer whose get_config() forgets its constructor argument (common, and
    harmless in plain Keras until the model is saved)."""

    def __init__(self, factor=1.0, offset=0.0, **kwargs):
        super().__init__(**kwargs)
        self.factor, self.offset = factor, offset

    def call(self, x):
        return x * self.factor + self.offset

    def get_config(self):
        return {**super().get_config(), 'offset': self.offset}  # forgets factor


def test_a_layer_whose_config_misses_an_argument_is_refused_by_name():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8), _Scale(5.0, name='scale'), keras.layers.Dense(2)]
    )
    with pytest.raises(ValueError, match=r"'scale' \(_Scale\).*'factor' is 5\.0.*1\.0"):
        GPipe(model, num_partitions=2)
    # The same layer with its argument in the config is fine (and predicts as the original).
    ok = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8),
            keras.layers.Rescaling(5.0),
            keras.layers.Dense(2),
        ]
    )
    _assert_close(GPipe(ok, num_partitions=2).predict(X, verbose=0), ok.predict(X, verbose=0))


def _two_outputs(as_dict):
    keras.utils.set_random_seed(0)
    x = keras.Input((8,), name='x')
    h = keras.layers.Dense(8, activation='tanh', name='h')(x)
    a = keras.layers.Dense(2, name='out_a')(h)
    b = keras.layers.Dense(1, name='out_b')(keras.layers.Dense(4, name='g')(h))
    return keras.Model(x, {'out_b': b, 'out_a': a} if as_dict else [a, b])


@pytest.mark.parametrize('as_dict', [False, True], ids=['list', 'dict'])
def test_named_outputs_name_losses_metrics_and_history_as_plain_keras(as_dict):
    ya = np.random.RandomState(1).randn(32, 2).astype('float32')
    yb = np.random.RandomState(2).randn(32, 1).astype('float32')
    y = {'out_a': ya, 'out_b': yb} if as_dict else [ya, yb]
    histories, predictions = [], []
    for pipelined in (False, True):
        model = _two_outputs(as_dict)
        if pipelined:
            model = GPipe(model, num_partitions=2, num_micro_batches=2)
            assert model.output_names == ['out_a', 'out_b']
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss={'out_a': 'mse', 'out_b': 'mae'},
            loss_weights={'out_a': 1.0, 'out_b': 0.5},
            metrics={'out_a': ['mae'], 'out_b': ['mse']},
        )
        histories.append(
            model.fit(X, y, batch_size=16, epochs=2, validation_split=0.25, verbose=0).history
        )
        predictions.append(model.predict(X, verbose=0))
    plain, pipe = histories
    assert sorted(pipe) == sorted(plain)
    assert 'val_out_a_loss' in pipe  # what EarlyStopping(monitor=...) needs
    for key in plain:
        np.testing.assert_allclose(pipe[key], plain[key], rtol=1e-5, err_msg=key)
    if as_dict:
        assert sorted(predictions[1]) == ['out_a', 'out_b']
    _assert_close(predictions[1], predictions[0])


def test_unseeded_dropout_draws_the_same_masks_however_often_it_is_pipelined():
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dropout(0.5), keras.layers.Dense(2)]
    )
    first = GPipe(model, num_partitions=2)(X, training=True)
    second = GPipe(model, num_partitions=2)(X, training=True)
    _assert_close(second, first, rtol=0, atol=0)


def _classifier(seed=0, regularized=False):
    keras.utils.set_random_seed(seed)
    reg = keras.regularizers.L2(1e-2) if regularized else None
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation='tanh', kernel_regularizer=reg),
            keras.layers.Dense(12, activation='relu'),
            keras.layers.Dense(8, activation='tanh'),
            keras.layers.Dense(3, activation='softmax'),
        ]
    )


Y3 = np.random.RandomState(1).randint(0, 3, 32)
W = np.random.RandomState(2).uniform(0.0, 2.0, 32).astype('float32')


@pytest.mark.parametrize('reduction', ['sum_over_batch_size', 'sum', 'mean_with_sample_weight'])
@pytest.mark.parametrize('weighted', [False, True], ids=['unweighted', 'sample_weight'])
def test_every_loss_reduction_trains_like_plain_keras_under_1f1b(reduction, weighted):
    """Each micro-batch's share of the loss by the compiled reduction (M=3 does not divide
    the batch of 10; a regularizer counts once)."""
    histories, models = [], []
    for pipelined in (False, True):
        model = _classifier(regularized=True)
        if pipelined:
            model = GPipe(model, num_partitions=2, num_micro_batches=3, schedule='1f1b')
        loss = keras.losses.SparseCategoricalCrossentropy(reduction=reduction)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
        fit = dict(batch_size=10, epochs=2, shuffle=False, verbose=0)
        histories.append(model.fit(X, Y3, sample_weight=W if weighted else None, **fit).history)
        models.append(model)
    np.testing.assert_allclose(histories[1]['loss'], histories[0]['loss'], rtol=1e-5)
    for a, b in zip(models[1].weights, models[0].weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_losses_that_cannot_be_shared_per_micro_batch_are_refused_by_name():
    x = keras.Input((8,), name='x')
    model = keras.Model(
        x, [keras.layers.Dense(2, name='out_a')(x), keras.layers.Dense(1, name='out_b')(x)]
    )
    pipe = GPipe(model, num_partitions=2, num_micro_batches=2, schedule='1f1b')
    ys = [np.zeros((32, 2), 'float32'), np.zeros((32, 1), 'float32')]
    pipe.compile(
        optimizer='sgd',
        loss={'out_a': keras.losses.MeanSquaredError(reduction='sum'), 'out_b': 'mse'},
    )
    with pytest.raises(ValueError, match=r"mix reductions.*'out_a': 'sum'.*schedule='gpipe'"):
        pipe.fit(X, ys, verbose=0)
    pipe.compile(optimizer='sgd', loss=keras.losses.MeanSquaredError(reduction=None))
    with pytest.raises(ValueError, match=r'reduction=None.*needs a scalar'):
        pipe.fit(X, ys, verbose=0)


def test_several_outputs_losses_with_a_recomputed_last_cell_are_refused_by_name():
    """Keras updates each output's loss tracker inside the loss; a recompute of the last cell
    would repeat it (the engine's own error named an AssignVariableOp in 'compile_loss')."""
    ys = [np.zeros((32, 2), 'float32'), np.zeros((32, 1), 'float32')]
    pipe = GPipe(
        _two_outputs(as_dict=False),
        num_partitions=2,
        num_micro_batches=2,
        schedule='1f1b',
        recompute='always',
    )
    pipe.compile(optimizer='sgd', loss=['mse', 'mse'])
    with pytest.raises(ValueError, match=r"several outputs, and recompute='always' under sch"):
        pipe.fit(X, ys, verbose=0)


def test_per_output_sum_losses_in_history_are_the_plain_model_s_under_gpipe():
    """Keras tracks each output's loss per call as a mean over rows: per micro-batch, a 'sum'
    loss's tracked value would be a quarter of the batch's at M=4 (found by trying under
    1f1b); under 'gpipe' such losses go on the merged output, so history is the plain one."""
    ya = np.random.RandomState(1).randn(32, 2).astype('float32')
    yb = np.random.RandomState(2).randn(32, 1).astype('float32')
    histories = []
    for pipelined in (False, True):
        model = _two_outputs(as_dict=False)
        if pipelined:
            model = GPipe(model, num_partitions=2, num_micro_batches=4, recompute='never')
        summed = keras.losses.MeanSquaredError(reduction='sum')
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=[summed, summed])
        fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
        histories.append(model.fit(X, [ya, yb], **fit).history)
    assert sorted(histories[1]) == sorted(histories[0])
    for key, values in histories[0].items():
        np.testing.assert_allclose(histories[1][key], values, rtol=1e-5, err_msg=key)


def _batch_centred(y_true, y_pred):
    """A loss that mixes examples: each prediction centred on the batch's mean."""
    centred = y_pred - tf.reduce_mean(y_pred, axis=0, keepdims=True)
    return tf.reduce_mean(tf.square(centred - tf.one_hot(tf.cast(y_true, tf.int32), 3)), -1)


def _sparse_brier(y_true, y_pred):
    """A per-example loss function (no reduction of its own)."""
    return tf.reduce_sum(tf.square(y_pred - tf.one_hot(tf.cast(y_true, tf.int32), 3)), -1)


@pytest.mark.parametrize('schedule', ['1f1b', 'zero_bubble'])
def test_a_loss_that_mixes_examples_is_refused_under_a_per_micro_batch_loss(schedule):
    """Found by trying: a batch-centred loss used to train silently differently under 1f1b
    (each micro-batch centred on its own mean); fit and compute_gradients refuse it by name."""
    pipe = GPipe(_classifier(), num_partitions=2, num_micro_batches=2, schedule=schedule)
    pipe.compile(optimizer='sgd', loss=_batch_centred)
    with pytest.raises(ValueError, match=r"compiled loss '_batch_centred' is not a sum over ex"):
        pipe.fit(X, Y3, verbose=0)
    with pytest.raises(ValueError, match=rf"the loss '_batch_centred'.*schedule={schedule!r}"):
        pipe.compute_gradients(X, Y3, loss=_batch_centred)


@pytest.mark.parametrize(
    'loss', ['sparse_categorical_crossentropy', _sparse_brier], ids=['name', 'function']
)
def test_compute_gradients_takes_a_loss_name_or_a_function(loss):
    """As compile() does (a function: per-example values, averaged); these used to raise."""
    plain = _classifier()
    pipe = GPipe(_classifier(), num_partitions=2, num_micro_batches=3, schedule='1f1b')
    fn = keras.losses.get(loss)
    with tf.GradientTape() as tape:
        want_loss = tf.reduce_mean(fn(Y3, plain(X, training=True)))
    want = tape.gradient(want_loss, plain.trainable_variables)
    got_loss, got = pipe.compute_gradients(X, Y3, loss=loss)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    _assert_close(got, want)


@pytest.mark.filterwarnings('ignore:Gradients do not exist')  # plain Keras's, as expected
@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_variable_no_loss_reaches_is_left_alone_as_in_plain_keras(schedule):
    """AdamW's weight decay and momentum skip a variable with no gradient (an output with
    loss=None); the pipeline's cells return zeros for it, which must not reach the optimizer."""
    ys = [np.random.RandomState(1).randn(32, 2).astype('float32'), np.zeros((32, 1), 'float32')]
    models = []
    for pipelined in (False, True):
        model = _two_outputs(as_dict=False)
        if pipelined:
            model = GPipe(model, num_partitions=2, num_micro_batches=2, schedule=schedule)
        model.compile(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.5), loss=['mse', None])
        model.fit(X, ys, batch_size=16, epochs=1, verbose=0)
        models.append(model)
    untouched = {'g', 'out_b'}
    for a, b in zip(models[1].weights, models[0].weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=b.path)
    changed = {
        w.path.split('/')[0]
        for w, w0 in zip(models[0].weights, _two_outputs(False).weights)
        if np.any(w.numpy() != w0.numpy())
    }
    assert changed and not changed & untouched, changed


@pytest.fixture
def float16_policy():
    keras.mixed_precision.set_global_policy('mixed_float16')
    yield
    keras.mixed_precision.set_global_policy('float32')


@pytest.mark.parametrize('schedule', ['1f1b', 'zero_bubble'])
def test_mixed_float16_skips_the_steps_plain_keras_skips(float16_policy, schedule):
    """Each micro-batch's backward starts from the loss scale times its share of the loss (not
    times its size): at M=1 the steps applied, the loss scale and the loss equal plain Keras's."""
    histories, models = [], []
    for pipelined in (False, True):
        model = _classifier()
        if pipelined:
            model = GPipe(model, num_partitions=2, num_micro_batches=1, schedule=schedule)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss='sparse_categorical_crossentropy')
        histories.append(model.fit(X, Y3, batch_size=32, epochs=4, verbose=0).history['loss'])
        models.append(model)
    plain, pipe = (m.optimizer for m in models)
    assert int(pipe.iterations.numpy()) == int(plain.iterations.numpy()) == 4
    assert float(pipe.dynamic_scale.numpy()) == float(plain.dynamic_scale.numpy())
    np.testing.assert_allclose(histories[1], histories[0], rtol=2e-3)
    for a, b in zip(models[1].weights, models[0].weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-3, atol=2e-4)


def _bn_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.Activation('relu'),
            keras.layers.Dense(3),
        ]
    )


def _tape_step(model, optimizer, loss_fn):
    with tf.GradientTape() as tape:
        loss = loss_fn(Y3, model(X, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


def test_a_custom_tape_loop_moves_batch_norm_as_plain_keras():
    """No extra call: the training call moves the averages (once, from the whole batch)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain, pipe = _bn_model(), GPipe(_bn_model(), num_partitions=2)
    for model in (plain, pipe):
        optimizer = keras.optimizers.SGD(0.1)
        for _ in range(4):
            _tape_step(model, optimizer, loss_fn)
    _assert_close(pipe.predict(X, verbose=0), plain.predict(X, verbose=0))
    # M=2: the step normalises per micro-batch, the averages move from the whole batch.
    plain, pipe = _bn_model(), GPipe(_bn_model(), num_partitions=2, num_micro_batches=2)
    for model in (plain, pipe):
        _tape_step(model, keras.optimizers.SGD(0.1), loss_fn)
    bn = [w for w in plain.non_trainable_weights]
    assert any(np.any(w.numpy() != 0) for w in bn)
    _assert_close(pipe.non_trainable_weights, plain.non_trainable_weights)


def test_training_calls_outside_fit_draw_new_dropout_masks():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dropout(0.5), keras.layers.Dense(2)]
    )
    pipe = GPipe(model, num_partitions=2, num_micro_batches=2)  # never compiled
    first, second = pipe(X, training=True), pipe(X, training=True)
    assert np.any(np.asarray(first) != np.asarray(second))
    _assert_close(pipe(X, training=False), model(X, training=False))


@pytest.mark.parametrize(
    'schedule,options',
    [
        ('gpipe', {'num_micro_batches': 3}),
        ('1f1b', {'num_micro_batches': 3}),
        ('zero_bubble', {'num_micro_batches': 3}),
        ('interleaved_1f1b', {'num_micro_batches': 2, 'virtual_stages': 2}),
    ],
)
@pytest.mark.parametrize('reduction', ['sum_over_batch_size', 'sum'])
def test_compute_gradients_equals_the_plain_tape_gradient(schedule, options, reduction):
    """A custom loop under every schedule: the loss (regularizers included, as Keras's
    compute_loss) and the gradients of the plain model's tape (M=3 does not divide 32)."""
    loss = keras.losses.SparseCategoricalCrossentropy(reduction=reduction)
    plain = _classifier(regularized=True)
    pipe = GPipe(
        _classifier(regularized=True),
        num_partitions=2,
        schedule=schedule,
        **options,
    )
    with tf.GradientTape() as tape:
        want_loss = loss(Y3, plain(X, training=True), sample_weight=W) + tf.add_n(plain.losses)
    want = tape.gradient(want_loss, plain.trainable_variables)
    got_loss, got = pipe.compute_gradients(X, Y3, loss=loss, sample_weight=W)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert len(got) == len(want)
    _assert_close(got, want)


def test_a_training_call_under_1f1b_names_compute_gradients():
    pipe = GPipe(_classifier(), num_partitions=2, num_micro_batches=2, schedule='1f1b')
    with pytest.raises(ValueError, match=r'model\.compute_gradients\(x, y\)'):
        pipe(X, training=True)


SERVE = """
import sys
import numpy as np
import tensorflow as tf
served = tf.saved_model.load(sys.argv[1])
np.save(sys.argv[3], served.serve(tf.constant(np.load(sys.argv[2]))).numpy())
"""


def _tagger(seed=0):
    keras.utils.set_random_seed(seed)
    x = keras.Input((8,), name='x')
    h = keras.layers.Dense(16, activation='relu', name='h')(x)
    h = keras.layers.BatchNormalization(name='bn')(h)
    h = keras.layers.Dropout(0.2, name='drop')(h)
    y = keras.layers.Dense(3, name='out')(
        keras.layers.Add(name='skip')([h, keras.layers.Dense(16)(x)])
    )
    return keras.Model(x, y, name='tagger')


@pytest.mark.parametrize('functional', [False, True], ids=['sequential', 'functional'])
def test_to_keras_and_export_serve_the_trained_model_without_tf_gpipe(tmp_path, functional):
    model = _tagger() if functional else _bn_model()
    pipe = GPipe(model, num_partitions=2, num_micro_batches=2)
    pipe.compile(keras.optimizers.Adam(0.01), 'sparse_categorical_crossentropy')
    pipe.fit(X, Y3, batch_size=16, epochs=2, verbose=0)
    want = pipe.predict(X, verbose=0)
    plain = pipe.to_keras()
    assert type(plain).__name__ in ('Functional', 'Sequential') and plain.name == model.name
    assert len(plain.weights) == len(model.weights)
    assert any(np.any(w.numpy() != 0) for w in plain.non_trainable_weights)  # moved averages
    _assert_close(plain.predict(X, verbose=0), want)
    pipe.export(str(tmp_path / 'served'))
    np.save(tmp_path / 'x.npy', X[:5])
    served, x, y = tmp_path / 'served', tmp_path / 'x.npy', tmp_path / 'y.npy'
    run_without_tf_gpipe(SERVE, served, x, y, cwd=tmp_path)
    _assert_close(np.load(tmp_path / 'y.npy'), want[:5])


@pytest.mark.parametrize('functional', [False, True], ids=['sequential', 'functional'])
def test_lambda_layers_train_like_plain_keras_and_come_back(functional):
    """A Lambda's Python function is carried as itself (Keras refuses to load serialized
    bytecode in safe mode): fit, predict and to_keras() as the plain model."""

    def model():
        keras.utils.set_random_seed(0)
        scale = keras.layers.Lambda(lambda t: t * 0.5 + 1.0, name='scale')
        if not functional:
            return keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(8), scale, keras.layers.Dense(3)]
            )
        x = keras.Input((8,))
        h = keras.layers.Dense(8)(x)
        return keras.Model(x, keras.layers.Dense(3)(keras.layers.Add()([scale(h), h])))

    plain, pipe = model(), GPipe(model(), num_partitions=2, num_micro_batches=2)
    for m in (plain, pipe):
        m.compile(keras.optimizers.SGD(0.1), 'sparse_categorical_crossentropy')
    fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(
        pipe.fit(X, Y3, **fit).history['loss'], plain.fit(X, Y3, **fit).history['loss'], rtol=1e-5
    )
    _assert_close(pipe.predict(X, verbose=0), plain.predict(X, verbose=0))
    _assert_close(pipe.to_keras().predict(X, verbose=0), plain.predict(X, verbose=0))


def test_a_layer_that_adds_a_loss_is_refused_at_construction_by_name():
    class Penalised(keras.layers.Layer):
        def call(self, x):
            self.add_loss(tf.reduce_mean(x**2))
            return x

    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(4), Penalised(name='pen'), keras.layers.Dense(2)]
    )
    with pytest.raises(ValueError, match=r"^Layer 'pen' \(Penalised\) adds a loss in its call"):
        GPipe(model, num_partitions=2)


def test_compiling_under_a_strategy_the_pipeline_was_not_built_under_is_refused():
    pipe = GPipe(_classifier(), num_partitions=2)
    strategy = tf.distribute.MirroredStrategy(['/device:CPU:0', '/device:CPU:1'])
    with strategy.scope():
        with pytest.raises(
            ValueError,
            match=r'built outside any strategy and is compiled inside '
            r'the scope of a MirroredStrategy.*mesh\.strategy\(\)\.scope\(\)',
        ):
            pipe.compile('sgd', 'mse')


def test_summary_shows_the_plain_models_shapes():
    lines = []
    model = _two_outputs(as_dict=False)
    GPipe(model, num_partitions=2).summary(print_fn=lines.append)
    text = '\n'.join(lines)
    assert '(None, 2)' in text and '(None, 1)' in text and '(None, 8)' in text, text
    assert 'GPipe: 2 cells' in text
