"""NestedMap: attribute access, reserved keys, flatten/pack, tf.nest and tf.function."""

import pytest
import tensorflow as tf

from tf_gpipe.nested_map import NestedMap


def _map():
    return NestedMap(b=1, a=NestedMap(y=2, x=[3, 4]), c=(5,))


def test_attribute_access_and_errors():
    m = _map()
    assert m.b == 1 and m.a.y == 2
    m.d = 6
    assert m['d'] == 6
    with pytest.raises(AttributeError, match="did you mean 'b'"):
        _ = m.bb
    with pytest.raises(ValueError, match='reserved'):
        m.keys = 1
    with pytest.raises(ValueError, match='identifier'):
        NestedMap({'not ok': 1})
    del m.d
    assert 'd' not in m


def test_flatten_pack_transform():
    m = _map()
    assert m.Flatten() == [3, 4, 2, 1, 5]
    assert [k for k, _ in m.FlattenItems()] == ['a.x.0', 'a.x.1', 'a.y', 'b', 'c.0']
    packed = m.Pack([10, 20, 30, 40, 50])
    assert isinstance(packed, NestedMap) and isinstance(packed.a, NestedMap)
    assert packed.a.x == [10, 20] and packed.c == (50,)
    doubled = m.Transform(lambda v: v * 2)
    assert doubled.a.y == 4 and m.a.y == 2
    assert m.IsCompatible(doubled) and not m.IsCompatible(NestedMap(b=1))
    assert m.GetItem('a.y') == 2


def test_filter_drops_empty_maps():
    m = NestedMap(a=NestedMap(x=1), b=5)
    assert m.Filter(lambda v: v > 2) == NestedMap(b=5)


def test_deep_copy_copies_structure():
    m = _map()
    c = m.DeepCopy()
    c.a.y = 9
    assert m.a.y == 2


def test_tf_nest_and_tf_function_keep_the_type():
    m = NestedMap(x=tf.ones([2]), y=NestedMap(z=tf.zeros([1])))
    out = tf.nest.map_structure(lambda t: t + 1, m)
    assert isinstance(out, NestedMap) and isinstance(out.y, NestedMap)

    @tf.function
    def f(inputs):
        return NestedMap(s=inputs.x * 2, t=inputs.y.z)

    res = f(m)
    assert isinstance(res, NestedMap)
    assert res.s.numpy().tolist() == [2.0, 2.0]


def test_filter_goes_into_lists_and_drops_what_is_left_empty():
    m = NestedMap(a=[1, 5, NestedMap(x=7, y=0)], b=NestedMap(c=[0, 1]), d=(9, 0), e=3)
    assert m.Filter(lambda v: v > 2) == NestedMap(a=[5, NestedMap(x=7)], d=(9,), e=3)
    assert m.Filter(lambda v: v > 100) == NestedMap()
