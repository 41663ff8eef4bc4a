"""Optimizer slots are created on their variables' devices."""

import pytest
import tensorflow as tf

from tf_gpipe import placement


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
