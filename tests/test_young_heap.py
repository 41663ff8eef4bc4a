"""gpipe.young_heap: full collections during a pipeline's build scan only what it allocates, and
the heap from before comes back at the end, garbage included."""

import gc
import threading
import weakref

import tensorflow as tf

from tf_gpipe import gpipe, layers
from tf_gpipe.gpipe import young_heap


class _Cycle:
    """A garbage cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def _garbage():
    """A weak reference to a cycle nobody holds any more."""
    ref = weakref.ref(_Cycle())
    assert ref() is not None
    return ref


def test_a_build_sets_aside_what_existed_and_gives_it_back_at_exit():
    assert gc.get_freeze_count() == 0
    old = _garbage()
    with tf.Graph().as_default(), young_heap.build():
        assert gc.get_freeze_count() > 0
        young = _garbage()
        gc.collect()
        assert young() is None  # what the build allocates is collected as ever
        assert old() is not None  # set aside: neither scanned nor collected
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old() is None  # given back, so collected after the build, not leaked


def test_eagerly_nothing_is_built_and_nothing_is_set_aside():
    with young_heap.build():
        assert gc.get_freeze_count() == 0


def test_a_program_that_froze_objects_itself_keeps_them_frozen(monkeypatch):
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        calls = []
        for name in ('freeze', 'unfreeze'):
            monkeypatch.setattr(gc, name, lambda name=name: calls.append(name))
        with tf.Graph().as_default(), young_heap.build():
            # Not an equal count: a frozen object that dies leaves the frozen set (another
            # thread's, or one the graph releases), so the count may fall, never rise.
            assert 0 < gc.get_freeze_count() <= theirs
        assert 0 < gc.get_freeze_count() <= theirs  # their unfreeze is theirs to call
        assert calls == []  # neither frozen again nor given back
    finally:
        monkeypatch.undo()
        gc.unfreeze()


def test_a_program_that_turned_the_collector_off_is_left_as_it_is():
    gc.disable()
    try:
        with tf.Graph().as_default(), young_heap.build():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_scopes_nest_and_overlap_across_threads_and_the_last_out_gives_back():
    entered, leave = threading.Event(), threading.Event()
    seen = {}

    def other():
        with tf.Graph().as_default(), young_heap.build():
            entered.set()
            leave.wait(30)
            seen['before_leaving'] = gc.get_freeze_count()

    with tf.Graph().as_default():
        with young_heap.build():
            with young_heap.build():  # nested in one thread
                assert gc.get_freeze_count() > 0
            assert gc.get_freeze_count() > 0
            thread = threading.Thread(target=other)
            thread.start()
            assert entered.wait(30)
        # This thread left first: the other's scope is still open.
        assert gc.get_freeze_count() > 0
        leave.set()
        thread.join(30)
    assert seen['before_leaving'] > 0
    assert gc.get_freeze_count() == 0


def _pipe():
    sub = [
        layers.FCLayer.Params().Set(name=f'fc{i}', input_dim=4, output_dim=4, activation='TANH')
        for i in range(4)
    ]
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            sub=sub,
            num_partitions=2,
            partition_by='uniform',
            num_micro_batches=2,
            random_seed=1,
        )
        .Instantiate()
    )


def test_a_pipelines_step_is_built_with_the_heap_set_aside():
    pipe = _pipe()
    x = tf.random.stateless_normal([4, 4], [1, 2])
    seen = []

    def loss_fn(out, t):
        seen.append(gc.get_freeze_count())  # called while ComputeGradients builds
        return tf.reduce_mean(out * t)

    backward = pipe._FPropBackward

    def recorded_backward(*args):  # built when the tape asks for FProp's gradient
        seen.append(gc.get_freeze_count())
        return backward(*args)

    pipe._FPropBackward = recorded_backward

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(pipe.FProp(x))
        fprop_grads = tape.gradient(loss, pipe.trainable_variables)
        return pipe.ComputeGradients(x, x, loss_fn), fprop_grads

    step.get_concrete_function()
    assert len(seen) == 3 and all(n > 0 for n in seen)  # 2 micro-batches' losses, 1 backward
    assert gc.get_freeze_count() == 0
    seen.clear()
    (loss, grads), _ = step()  # the built step runs as ever, the heap not set aside
    assert not seen and gc.get_freeze_count() == 0
    eager_loss, eager_grads = pipe.ComputeGradients(x, x, loss_fn)  # eagerly: nothing built
    assert seen and not any(seen)
    assert abs(float(loss) - float(eager_loss)) < 1e-6
    for g, e in zip(grads, eager_grads):
        assert float(tf.reduce_max(tf.abs(g - e))) < 1e-6
