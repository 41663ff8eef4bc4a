"""runtime/variables.backing: the tf.Variable behind what a user hands us, whatever it is."""

import keras
import tensorflow as tf

from tf_gpipe.runtime import placement
from tf_gpipe.runtime.variables import backing


def test_backing_is_the_tf_variable_of_a_keras_one_and_anything_else_itself():
    plain = tf.Variable(tf.zeros([2]))
    wrapped = keras.Variable(tf.ones([3]))
    tensor = tf.constant(1.0)
    assert backing(plain) is plain and backing(tensor) is tensor
    assert isinstance(backing(wrapped), tf.Variable)
    assert backing(wrapped).handle is backing(wrapped).handle  # one variable, not a read
    # what placement reports of a Keras variable is its tf.Variable's device
    assert placement.device_of(wrapped) == backing(wrapped).device != ''
