"""params_text: one value's text form and back (literals, dtypes, classes by module path, data
only), and the type check against the field's current value."""

import pytest
import tensorflow as tf

from tf_gpipe import hyperparams, layers, params_text


@pytest.mark.parametrize(
    'value',
    [3, -2.5, 'a "quoted"\nline', True, None, [1, (2,)], {'k': [tf.float32]}, layers.FCLayer],
)
def test_encode_then_decode_is_the_value(value):
    assert params_text.decode(params_text.encode(value, 'x'), None, 'x') == value


def test_decode_checks_the_fields_type():
    assert params_text.decode('4', 1.0, 'x') == 4.0 and isinstance(
        params_text.decode('4', 1.0, 'x'), float
    )
    assert params_text.decode('RELU', 'NONE', 'x') == 'RELU'  # an unquoted word for a string
    with pytest.raises(ValueError, match=r"Parameter 'x' expects an int \(current value 1\)"):
        params_text.decode('many', 1, 'x')


def test_text_names_no_class_outside_tf_gpipe():
    for text in ('type/os/system', 'type/subprocess/Popen'):
        with pytest.raises(ValueError, match='imports and runs nothing else'):
            params_text.decode(text, None, 'cls')


def test_a_moved_class_is_found_by_its_old_module_name():
    """A params text written before a module moved (a logdir's params.txt) still reads."""
    p = hyperparams.Params()
    p.Define('layer', layers.FCLayer.Params(), '')
    p.FromText('layer.cls : type/tf_gpipe.layers.keras_layer/KerasLayer')
    assert p.layer.cls is layers.KerasLayer
    p.FromText('layer.cls : type/tf_gpipe.layers.sequential/SequentialLayer')
    assert p.layer.cls is layers.SequentialLayer
