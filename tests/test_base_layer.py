"""BaseLayer: params, children, variables, seeded initialisation, inheritance, tracking."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe import base_layer, layers


def _fc(name='fc', **kw):
    return layers.FCLayer.Params().Set(name=name, input_dim=4, output_dim=3, **kw)


def _values(layer):
    return {v.name: v.numpy() for v in layer.trainable_variables}


def test_params_fields():
    p = base_layer.BaseLayer.Params()
    for field in (
        'cls',
        'name',
        'dtype',
        'fprop_dtype',
        'params_init',
        'random_seed',
        'skip_lp_regularization',
    ):
        assert field in p
    assert p.cls is base_layer.BaseLayer


def test_name_is_required():
    with pytest.raises(ValueError, match='needs a name'):
        layers.FCLayer.Params().Set(input_dim=2, output_dim=2).Instantiate()


@pytest.mark.parametrize(
    'init,check',
    [
        (base_layer.WeightInit.Constant(0.1), lambda w: np.allclose(w, 0.1)),
        (base_layer.WeightInit.Uniform(0.2), lambda w: np.abs(w).max() <= 0.2),
        (base_layer.WeightInit.Gaussian(2.0), lambda w: 1.8 < w.std() < 2.2),
        (base_layer.WeightInit.TruncatedGaussian(1.0), lambda w: np.abs(w).max() <= 2.0),
        (
            base_layer.WeightInit.Xavier(1.0),
            lambda w: np.abs(w).max() <= np.sqrt(6 / (100 + 200)) and w.std() > 0.03,
        ),
        (base_layer.WeightInit.GaussianSqrtDim(1.0), lambda w: 0.08 < w.std() < 0.12),
    ],
)
def test_weight_init(init, check):
    p = layers.FCLayer.Params().Set(name='fc', input_dim=100, output_dim=200, params_init=init)
    w = p.Instantiate().vars.w.numpy()
    assert check(w)


def test_unknown_init_method():
    init = base_layer.WeightInit.Gaussian(1.0)
    init.method = 'gausian'
    with pytest.raises(ValueError, match='Unknown WeightInit'):
        _fc(params_init=init).Instantiate()


def test_seeded_init_is_a_function_of_seed_name_and_variable():
    a = _fc(random_seed=5).Instantiate()
    b = _fc(random_seed=5).Instantiate()
    c = _fc(random_seed=6).Instantiate()
    d = _fc(name='fc2', random_seed=5).Instantiate()
    np.testing.assert_array_equal(a.vars.w, b.vars.w)
    assert not np.allclose(a.vars.w, c.vars.w)
    assert not np.allclose(a.vars.w, d.vars.w)
    # Unseeded layers differ from each other.
    assert not np.allclose(_fc().Instantiate().vars.w, _fc().Instantiate().vars.w)


def test_seeded_init_does_not_depend_on_the_container():
    tr = layers.TransformerLayer.Params().Set(name='tr0', input_dim=8, num_heads=2)
    alone = tr.Copy().Set(random_seed=1).Instantiate()
    seq = layers.SequentialLayer.Params().Set(name='seq', random_seed=1, sub=[_fc(), tr.Copy()])
    nested = layers.SequentialLayer.Params().Set(
        name='outer',
        random_seed=1,
        sub=[layers.SequentialLayer.Params().Set(name='cell3', sub=[tr.Copy()])],
    )
    in_seq = seq.Instantiate().sub[1]
    in_nested = nested.Instantiate().sub[0].sub[0]
    for other in (in_seq, in_nested):
        assert len(other.trainable_variables) == len(alone.trainable_variables)
        for v1, v2 in zip(alone.trainable_variables, other.trainable_variables):
            np.testing.assert_array_equal(v1, v2)
    # Same-named children of different parents differ (the seed name includes the parent).
    two = (
        layers.SequentialLayer.Params()
        .Set(name='two', random_seed=1, sub=[tr.Copy(), tr.Copy().Set(name='tr1')])
        .Instantiate()
    )
    assert not np.allclose(two.sub[0].atten.vars.w_query, two.sub[1].atten.vars.w_query)
    assert two.sub[1].atten.seed_name == 'tr1/atten'


def test_children_inherit_unless_set():
    seq = (
        layers.SequentialLayer.Params()
        .Set(
            name='seq',
            random_seed=3,
            dtype=tf.float64,
            params_init=base_layer.WeightInit.Constant(0.5),
            sub=[
                _fc('a'),
                _fc('b', random_seed=9, params_init=base_layer.WeightInit.Constant(2.0)),
            ],
        )
        .Instantiate()
    )
    a, b = seq.sub
    assert a.params.random_seed == 3 and a.params.dtype == tf.float64
    assert a.vars.w.dtype == tf.float64 and np.allclose(a.vars.w, 0.5)
    assert b.params.random_seed == 9 and np.allclose(b.vars.w, 2.0)


def test_duplicate_sub_layer_names_are_refused():
    with pytest.raises(ValueError, match='must be unique'):
        layers.SequentialLayer.Params().Set(name='s', sub=[_fc(), _fc()]).Instantiate()


def test_params_are_frozen_copies():
    p = _fc()
    layer = p.Instantiate()
    p.output_dim = 7
    assert layer.params.output_dim == 3
    with pytest.raises(TypeError, match='frozen'):
        layer.params.output_dim = 5


def test_variables_are_tracked_and_checkpointable(tmp_path):
    seq = layers.SequentialLayer.Params().Set(
        name='s', sub=[_fc('a'), layers.BatchNormLayer.Params().Set(name='bn', dim=3)]
    )
    model = seq.Instantiate()
    assert len(model.trainable_variables) == 4
    assert len(model.variables) == 4 + 5  # moving stats and accumulators
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / 'ckpt'))
    before = _values(model)
    other = seq.Instantiate()
    tf.train.Checkpoint(model=other).read(path).assert_consumed()
    for v in other.trainable_variables:
        np.testing.assert_array_equal(v.numpy(), before[v.name])


def test_fprop_meta_not_implemented_is_clear():
    with pytest.raises(NotImplementedError, match='BaseLayer does not implement FPropMeta'):
        base_layer.BaseLayer.FPropMeta(base_layer.BaseLayer.Params(), (1,))


def test_all_layers_and_post_training_step_update_recurse():
    seq = (
        layers.SequentialLayer.Params()
        .Set(name='s', sub=[_fc('a'), layers.BatchNormLayer.Params().Set(name='bn', dim=3)])
        .Instantiate()
    )
    assert [type(x).__name__ for x in seq.AllLayers()] == [
        'SequentialLayer',
        'FCLayer',
        'BatchNormLayer',
    ]
    seq.FProp(tf.ones([2, 4]))
    assert seq.sub[1].vars.acc_count.numpy() == 2
    seq.PostTrainingStepUpdate()
    assert seq.sub[1].vars.acc_count.numpy() == 0


class _Clipped(layers.FCLayer):
    """An FProp that branches on a tensor's value: the layer asks for AutoGraph."""

    _AUTOGRAPH = True

    def FProp(self, inputs):
        y = super().FProp(inputs)
        if tf.reduce_max(y) > 1.0:  # a Python `if` on a tensor: needs AutoGraph in a graph
            y = y / tf.reduce_max(y)
        return y


def test_autograph_opt_in_converts_fprop_even_in_a_step_traced_without_autograph():
    """The trainer traces its step with autograph=False (converting every layer cost seconds);
    a layer with _AUTOGRAPH = True still gets its tensor-valued `if` converted."""
    layer = _Clipped.Params().Set(name='c', input_dim=4, output_dim=3).Instantiate()
    x = 10.0 * tf.ones([2, 4])
    want = layer.FProp(x)  # eagerly
    got = tf.function(layer.FProp, autograph=False)(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(tf.reduce_max(got)) <= 1.0 + 1e-6
    with pytest.raises(TypeError):  # without the opt-in, such code cannot be traced
        tf.function(_branch, autograph=False)(x)


def _branch(t):
    if tf.reduce_max(t) > 1.0:
        return t
    return -t
