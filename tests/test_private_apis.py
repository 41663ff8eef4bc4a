"""The private TF / Keras APIs the README lists: each import and its behaviour, so an upgrade
that moves or changes one fails here, by name, rather than somewhere deep in a pipeline."""

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
