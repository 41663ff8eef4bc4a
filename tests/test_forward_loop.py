"""Eval as a loop over ticks (forward_loop.py, PipelinedLayer.eval_loop, the default) gives
the unrolled wave's outputs, and its program does not grow with M.

Compared on the same weights: K = 2 and 4 (and interleaved, two cells per device), M = 1, 3
and 4, a batch dimension other than 0, integer inputs (an embedding), a batch size known only
at run time; the program: nodes of the traced eval, outer graph and function library, equal
at M=4 and M=8.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.test_backward_loop import _while_loops
from tf_gpipe import fprop_context, gpipe, layers
from tf_gpipe.gpipe import forward_loop


def _fc_stack(n=4, dim=6):
    fc = layers.FCLayer.Params().Set(input_dim=dim, output_dim=dim, activation='TANH')
    drop = layers.DropoutLayer.Params().Set(keep_prob=0.7)  # a no-op in eval
    return [drop.Copy().Set(name='drop')] + [fc.Copy().Set(name=f'fc{i}') for i in range(n)]


def _pipe(loop, m=4, k=2, sub=None, **kw):
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            random_seed=1234,
            sub=sub or _fc_stack(),
            num_partitions=k,
            partition_by='uniform',
            num_micro_batches=m,
            eval_loop=loop,
            **kw,
        )
        .Instantiate()
    )


def _eval(pipe, *inputs, signature=None):
    def run(*xs):
        with fprop_context.eval_mode():
            return pipe.FProp(*xs)

    fn = tf.function(run, input_signature=signature, autograph=False)
    return fn, tf.nest.map_structure(np.asarray, fn(*inputs))


@pytest.mark.parametrize(
    'k,m,kw',
    [
        (2, 4, {}),
        (4, 3, {}),
        (2, 1, {}),
        (2, 4, dict(schedule='interleaved_1f1b', virtual_stages=2)),
    ],
)
def test_equals_the_unrolled_wave(k, m, kw):
    x = tf.random.stateless_normal([4 * m, 6], [1, 2])
    _, want = _eval(_pipe(False, m, k, **kw), x)
    fn, got = _eval(_pipe(True, m, k, **kw), x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert _while_loops(fn.get_concrete_function(x).graph) == (m > 1)


def test_batch_dim_one_integer_inputs_and_a_batch_size_known_at_run_time():
    emb = layers.EmbeddingLayer.Params().Set(name='emb', vocab_size=7, embedding_dim=6)
    sub = [emb] + _fc_stack(3)
    ids = tf.constant(np.arange(5 * 8).reshape(5, 8) % 7, tf.int32)  # time-major: [T, B]
    _, want = _eval(_pipe(False, sub=sub, batch_dim=1), ids)
    fn, got = _eval(_pipe(True, sub=sub, batch_dim=1), ids)
    assert got.shape == (5, 8, 6)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert fn.get_concrete_function(ids).structured_outputs.shape == (5, 8, 6)
    # Batch unknown while tracing: split at run time, 10 examples as 3, 3, 2, 2.
    x = tf.random.stateless_normal([10, 6], [3, 4])
    spec = [tf.TensorSpec([None, 6], tf.float32)]
    _, want = _eval(_pipe(False), x, signature=spec)
    fn, got = _eval(_pipe(True), x, signature=spec)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert _while_loops(fn.get_concrete_function().graph)


def test_the_program_does_not_grow_with_m():
    def nodes(m):
        pipe = _pipe(True, m, k=4, sub=_fc_stack(8))
        fn, _ = _eval(pipe, tf.ones([2 * m, 6]))
        graph = fn.get_concrete_function(tf.ones([2 * m, 6])).graph.as_graph_def()
        return len(graph.node), sum(len(f.node_def) for f in graph.library.function)

    assert nodes(4) == nodes(8)


def test_what_it_cannot_run_falls_back_with_a_reason(caplog):
    micro = [tf.ones([2, 3]), tf.ones([2, 3])]
    assert forward_loop.unsupported(micro) == 'eager execution'
    reasons = []

    @tf.function(autograph=False)
    def probe():
        reasons.append(forward_loop.unsupported([tf.ones([3, 3]), tf.ones([2, 3])]))
        reasons.append(forward_loop.unsupported(micro))
        return tf.constant(0)

    probe()
    assert reasons == ['micro-batches of different sizes', None]
    x = tf.random.stateless_normal([5, 6], [1, 2])  # M=2: 3 and 2 examples
    _, want = _eval(_pipe(False, m=2), x)
    fn, got = _eval(_pipe(True, m=2), x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not _while_loops(fn.get_concrete_function(x).graph)
    assert 'runs unrolled' in caplog.text and 'micro-batches of different sizes' in caplog.text


def test_keras_predict_and_evaluate_run_the_loop_like_plain_keras(caplog, monkeypatch):
    import keras

    from tf_gpipe.keras import GPipe

    def mlp():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation='relu'),
                keras.layers.Dropout(0.5),
                keras.layers.Dense(3),
            ]
        )

    x = np.random.RandomState(0).randn(40, 8).astype('float32')
    y = np.random.RandomState(1).randint(0, 3, 40)
    built = []
    run = forward_loop.ForwardLoop.Run
    monkeypatch.setattr(
        forward_loop.ForwardLoop, 'Run', lambda self, m, **kw: built.append(1) or run(self, m, **kw)
    )
    plain = mlp()
    pipe = GPipe(mlp(), num_partitions=2, num_micro_batches=4)  # eval_loop: the default
    for m in (plain, pipe):
        m.compile('sgd', 'sparse_categorical_crossentropy')
    # 40 = 16 + 16 + 8: the batch is known only at run time; the last one is smaller.
    np.testing.assert_allclose(
        pipe.predict(x, batch_size=16, verbose=0),
        plain.predict(x, batch_size=16, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        pipe.evaluate(x, y, batch_size=16, verbose=0),
        plain.evaluate(x, y, batch_size=16, verbose=0),
        rtol=1e-5,
    )
    assert built and 'runs unrolled' not in caplog.text
