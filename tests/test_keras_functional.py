"""GPipe(functional keras.Model): the graph read as a sequence of calls carrying the live
tensors (tf_gpipe/keras/functional.py, layers/keras_node.py), cut anywhere, exact."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe.keras import GPipe, functional

X = np.random.RandomState(0).randn(64, 8).astype('float32')
Y = np.random.RandomState(1).randint(0, 3, 64)


def _residual(seed=0):
    """A skip over two layers, the input rejoining late, and a layer called twice."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((8,))
    shared = keras.layers.Dense(8, activation='tanh', name='shared')
    h = shared(x)
    a = keras.layers.Dense(16, activation='relu', name='a')(h)
    b = keras.layers.Dense(8, name='b')(a)
    s = keras.layers.Add(name='add')([h, b])
    c = keras.layers.Concatenate(name='cat')([s, x])
    d = keras.layers.Dense(8, name='d')(c)
    e = shared(d)
    out = keras.layers.Dense(3, activation='softmax', name='out')(e)
    return keras.Model(x, out, name='residual')


def _compile(model, optimizer=None):
    model.compile(
        optimizer or keras.optimizers.SGD(0.1, momentum=0.9), 'sparse_categorical_crossentropy'
    )
    return model


def _assert_same_weights(got, want):
    assert len(got.weights) == len(want.weights)
    for a, b in zip(got.weights, want.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=b.path)


def test_steps_keep_exactly_the_tensors_read_later():
    steps, inputs, outputs, specs = functional.steps_of(_residual())
    names = [s.layer.name for s in steps]
    assert names == ['shared', 'a', 'b', 'add', 'cat', 'd', 'shared', 'out']
    by = dict(zip(range(len(steps)), steps))
    (x,) = inputs
    h = by[0].outputs[0]
    # h rides over a and b to the Add; the input x rides over five calls to the Concatenate.
    assert [h in s.keep for s in steps] == [True, True, True, False, False, False, False, False]
    assert [x in s.keep for s in steps] == [True, True, True, True, False, False, False, False]
    assert by[3].args == [[h, by[2].outputs[0]]]  # Add takes one list argument
    assert steps[-1].keep == outputs and specs[outputs[0]] == ((None, 3), 'float32')


@pytest.mark.parametrize('k', [1, 2, 4])
def test_fit_equals_the_plain_functional_model(k):
    plain = _compile(_residual())
    pipe = _compile(GPipe(_residual(), num_partitions=k, num_micro_batches=4))
    assert pipe.num_partitions == k
    fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(
        pipe.fit(X, Y, **fit).history['loss'], plain.fit(X, Y, **fit).history['loss'], rtol=1e-5
    )
    _assert_same_weights(pipe, plain)  # the shared layer's two uses land in cells 0 and K-1
    np.testing.assert_allclose(pipe.predict(X[:5], verbose=0), plain.predict(X[:5], verbose=0),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def test_other_schedules_and_save_load(tmp_path):
    plain = _compile(_residual(), keras.optimizers.Adam(0.01, epsilon=1e-3))
    pipe = _compile(
        GPipe(_residual(), num_partitions=2, num_micro_batches=4, schedule='1f1b'),
        keras.optimizers.Adam(0.01, epsilon=1e-3),
    )
    fit = dict(batch_size=16, epochs=1, shuffle=False, verbose=0)
    pipe.fit(X, Y, **fit), plain.fit(X, Y, **fit)
    _assert_same_weights(pipe, plain)
    path = str(tmp_path / 'residual.keras')
    pipe.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.num_partitions == 2 and loaded.balance == pipe.balance
    np.testing.assert_allclose(loaded.predict(X[:4], verbose=0), pipe.predict(X[:4], verbose=0),
                               rtol=1e-6)  # fmt: skip


def test_attention_with_two_positional_inputs_and_integer_ids():
    def model():
        keras.utils.set_random_seed(5)
        ids = keras.Input((6,), dtype='int32')
        e = keras.layers.Embedding(20, 8, name='emb')(ids)
        a = keras.layers.MultiHeadAttention(2, 4, name='mha')(e, e)  # query, value
        n = keras.layers.LayerNormalization(name='ln')(keras.layers.Add(name='res')([e, a]))
        out = keras.layers.Dense(3, name='out')(keras.layers.GlobalAveragePooling1D(name='gap')(n))
        return keras.Model(ids, out)

    ids = np.random.RandomState(2).randint(0, 20, (16, 6)).astype('int32')
    y = np.random.RandomState(3).randint(0, 3, 16)
    plain, pipe = model(), GPipe(model(), num_partitions=3, num_micro_batches=2)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def grads(m):
        with tf.GradientTape() as tape:
            value = loss(y, m(ids, training=True))
        return value, tape.gradient(value, m.trainable_variables)

    (l1, g1), (l2, g2) = grads(pipe), grads(plain)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    assert len(g1) == len(g2)
    for a, b in zip(g1, g2):  # the embedding's gradient is sparse in both
        a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _two_in_two_out(seed=0):
    keras.utils.set_random_seed(seed)
    a, b = keras.Input((8,), name='a'), keras.Input((4,), name='b')
    h = keras.layers.Dense(8, activation='relu', name='h')(a)
    g = keras.layers.Dense(8, activation='relu', name='g')(b)
    m = keras.layers.Concatenate(name='m')([h, g])
    n = keras.layers.Dense(8, activation='tanh', name='n')(m)
    cls = keras.layers.Dense(3, activation='softmax', name='cls')(n)
    reg = keras.layers.Dense(1, name='reg')(keras.layers.Add(name='skip')([n, h]))
    return keras.Model([a, b], [cls, reg])


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_several_inputs_and_outputs(schedule):
    xb = np.random.RandomState(4).randn(64, 4).astype('float32')
    z = np.random.RandomState(5).randn(64, 1).astype('float32')

    def compiled(model):
        model.compile(
            keras.optimizers.SGD(0.05, momentum=0.9),
            loss=['sparse_categorical_crossentropy', 'mse'],
            loss_weights=[1.0, 0.5],
        )
        return model

    plain = compiled(_two_in_two_out())
    pipe = compiled(
        GPipe(_two_in_two_out(), num_partitions=3, num_micro_batches=4, schedule=schedule)
    )
    fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    got = pipe.fit([X, xb], [Y, z], **fit).history
    want = plain.fit([X, xb], [Y, z], **fit).history
    np.testing.assert_allclose(got['loss'], want['loss'], rtol=1e-5)
    _assert_same_weights(pipe, plain)
    out = pipe.predict({'a': X[:5], 'b': xb[:5]}, verbose=0)  # a dict by input name works too
    for o, w in zip(out, plain.predict([X[:5], xb[:5]], verbose=0)):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r'takes 2 inputs \(a, b\)'):
        pipe(X[:2])


def test_refusals():
    ids = keras.Input((5,), dtype='int32')
    masked = keras.Model(ids, keras.layers.Embedding(10, 4, mask_zero=True)(ids))
    with pytest.raises(ValueError, match='produces a Keras mask'):
        GPipe(masked)


def test_resnet50_unchanged_at_k4_steps_like_plain_keras():
    """keras.applications.ResNet50 built unchanged, K=4, M=1: one SGD step changes every weight
    as the plain model's does, within the plain model's own float noise (its eager and
    tf.function gradients differ by ~0.4% here: 53 batch norms over 16 examples)."""

    def model():
        keras.utils.set_random_seed(1)
        return keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)

    x = tf.random.stateless_normal([16, 64, 64, 3], [1, 2])
    y = np.arange(16) % 10
    plain = model()
    pipe = GPipe(model(), num_partitions=4, num_micro_batches=1, recompute='always')
    assert min(pipe.balance) > 30 and len(pipe.trainable_variables) == 214

    loss = keras.losses.SparseCategoricalCrossentropy()

    def grads():
        with tf.GradientTape() as tape:
            value = loss(y, plain(x, training=True))
        return tape.gradient(value, plain.trainable_variables)

    eager, traced = grads(), tf.function(grads)()
    floor = max(float(np.abs(a - b).max()) for a, b in zip(eager, traced)) / max(
        float(np.abs(a).max()) for a in eager
    )
    before = [v.numpy() for v in plain.trainable_variables]
    for m in (plain, pipe):
        m.compile(keras.optimizers.SGD(0.01), 'sparse_categorical_crossentropy')
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    want = [v.numpy() - b for v, b in zip(plain.trainable_variables, before)]
    got = [v.numpy() - b for v, b in zip(pipe.trainable_variables, before)]
    scale = max(float(np.abs(w).max()) for w in want)
    worst = max(float(np.abs(g - w).max()) for g, w in zip(got, want)) / scale
    assert worst <= max(3 * floor, 1e-4), (worst, floor)
    assert all(np.any(g != 0) for g, w in zip(got, want) if np.any(w != 0))
