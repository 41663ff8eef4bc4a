"""Activations by name."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe.layers import activations


def test_known_activations():
    x = tf.constant([-1.0, 0.5])
    np.testing.assert_allclose(activations.get('RELU')(x), [0.0, 0.5])
    np.testing.assert_allclose(activations.get('NONE')(x), x)
    assert activations.flops_per_element('NONE') == 0


def test_unknown_activation_names_the_closest():
    with pytest.raises(ValueError, match="did you mean 'GELU'"):
        activations.get('gelu')
