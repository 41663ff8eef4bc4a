"""Optimizer slots, and the update work, on their variables' devices."""

import numpy as np
import pytest
import tensorflow as tf

from tests.placement_testing import ASSIGNS, misplaced_updates
from tf_gpipe.runtime import placement


@pytest.mark.parametrize(
    'make',
    [
        lambda: tf.keras.optimizers.Adam(0.1),
        lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: tf.keras.optimizers.RMSprop(0.1),
    ],
)
def test_slots_follow_variables(make):
    variables = []
    for i in (1, 2, 3):
        with tf.device(f'/device:CPU:{i}'):
            variables.append(tf.Variable(tf.ones([3]) * i))
    optimizer = placement.build_optimizer(make(), variables)
    slots = [v for v in optimizer.variables if tuple(v.shape) == (3,)]
    assert slots, 'this optimizer has per-variable slots'
    for slot in slots:
        assert slot.value.device[-5:] in {v.device[-5:] for v in variables}
    assert {s.value.device[-5:] for s in slots} == {'CPU:1', 'CPU:2', 'CPU:3'}
    optimizer.apply_gradients(zip([tf.ones([3])] * 3, variables))
    assert float(variables[0][0]) < 1.0
    assert placement.build_optimizer(optimizer, variables) is optimizer  # built once


def test_loss_scale_optimizer_slots_follow_variables():
    with tf.device('/device:CPU:2'):
        v = tf.Variable(tf.ones([3]))
    optimizer = placement.build_optimizer(
        tf.keras.optimizers.LossScaleOptimizer(tf.keras.optimizers.Adam(0.1)), [v]
    )
    slots = [s for s in optimizer.variables if tuple(s.shape) == (3,)]
    assert len(slots) == 2 and all(s.value.device.endswith('CPU:2') for s in slots)


# ---- where the update work runs ---------------------------------------------------------------


def _variables_on(devices, shape=(4, 3)):
    out = []
    for i, d in enumerate(devices):
        with tf.device(d):
            out.append(tf.Variable(tf.ones(shape) * (i + 1), name=f'v{i}'))
    return out


@pytest.mark.parametrize(
    'make',
    [
        lambda: tf.keras.optimizers.Adam(0.1),
        lambda: tf.keras.optimizers.AdamW(0.1, weight_decay=0.01, global_clipnorm=1.0),
        lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=1.0),
        lambda: tf.keras.optimizers.RMSprop(0.1, clipvalue=0.5),
        lambda: tf.keras.optimizers.LossScaleOptimizer(tf.keras.optimizers.Adam(0.1)),
    ],
)
def test_updates_run_on_the_variables_devices(make):
    variables = _variables_on(['/device:CPU:1', '/device:CPU:3'])
    grads = []
    for v in variables:
        with tf.device(v.device):
            grads.append(tf.ones_like(v) * 3.0)
    optimizer = placement.build_optimizer(make(), variables)

    @tf.function
    def step():
        # The caller's scope is some other device: updates must not follow it.
        with tf.device('/device:CPU:0'):
            placement.apply_gradients(optimizer, zip(grads, variables))

    graph = step.get_concrete_function().graph
    assert misplaced_updates(graph) == []
    assert sum(op.type in ASSIGNS for op in graph.get_operations()) >= 2


@pytest.mark.parametrize(
    'make',
    [
        lambda: tf.keras.optimizers.AdamW(0.1, weight_decay=0.05, global_clipnorm=0.3),
        lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.5),
    ],
)
def test_updates_follow_variables_same_numbers_as_keras(make):
    """Colocating changes where the ops run, not what they compute — with a sparse gradient
    whose slices repeat a row, which Keras's global norm squares slice by slice."""

    def run(colocate):
        variables = _variables_on(['/device:CPU:1', '/device:CPU:2'])
        optimizer = make()
        apply = placement.apply_gradients if colocate else type(optimizer).apply_gradients
        if colocate:
            placement.build_optimizer(optimizer, variables)
        grads = [
            tf.reshape(tf.range(12.0), (4, 3)),
            tf.IndexedSlices(tf.ones([3, 3]) * 2.0, tf.constant([1, 1, 3]), tf.constant([4, 3])),
        ]
        step = tf.function(lambda: apply(optimizer, zip(grads, variables)))
        for _ in range(3):
            step()
        return [v.numpy() for v in variables], optimizer

    (got, optimizer), (want, _) = run(True), run(False)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    # The user's optimizer is left as it was: no method replaced on the instance.
    assert not set(vars(optimizer)) & set(placement._HOOKED)
