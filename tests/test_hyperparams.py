"""Params: definition, access, did-you-mean errors, freezing, copying, text round trips."""

import pytest
import tensorflow as tf

from tf_gpipe import hyperparams, layers


class _Thing:
    """A class to instantiate from params."""

    def __init__(self, params, extra=None):
        self.params = params
        self.extra = extra


def _params():
    p = hyperparams.Params()
    p.Define('dim', 8, 'Width.')
    p.Define('name', 'x', 'A name.')
    inner = hyperparams.Params()
    inner.Define('rate', 0.5, 'A rate.')
    inner.Define('steps', 10, 'Steps.')
    p.Define('inner', inner, 'Nested params.')
    return p


def test_define_get_set():
    p = _params()
    assert p.dim == 8 and p.Get('dim') == 8
    p.dim = 16
    assert p.dim == 16
    assert p.Set(dim=32) is p and p.dim == 32
    p.Set(**{'inner.rate': 0.25})
    assert p.inner.rate == 0.25 and p.Get('inner.rate') == 0.25
    assert 'dim' in p and 'nope' not in p
    assert p.GetKeys() == ['dim', 'inner', 'name']
    assert [k for k, _ in p.IterParams()] == ['dim', 'name', 'inner']


def test_define_rejects_bad_and_duplicate_names():
    p = _params()
    with pytest.raises(AttributeError, match='already defined'):
        p.Define('dim', 1, '')
    with pytest.raises(ValueError, match='identifier'):
        p.Define('not valid', 1, '')
    with pytest.raises(ValueError, match='identifier'):
        p.Define('1abc', 1, '')


def test_unknown_names_name_the_closest():
    p = _params()
    with pytest.raises(AttributeError, match="did you mean 'dim'"):
        p.dimm = 1
    with pytest.raises(AttributeError, match="did you mean 'dim'"):
        _ = p.dimm
    with pytest.raises(AttributeError, match="did you mean 'rate'"):
        p.Set(**{'inner.rat': 1})
    with pytest.raises(AttributeError, match="did you mean 'steps'"):
        p.Get('inner.step')


def test_delete():
    p = _params()
    p.Delete('dim', 'inner.steps')
    assert 'dim' not in p and 'steps' not in p.inner
    with pytest.raises(AttributeError, match="did you mean 'name'"):
        p.Delete('nam')


def test_freeze():
    p = _params().Freeze()
    assert p.IsImmutable() and p.inner.IsImmutable()
    with pytest.raises(TypeError, match='frozen'):
        p.dim = 3
    with pytest.raises(TypeError, match='frozen'):
        p.Set(**{'inner.rate': 1.0})
    with pytest.raises(TypeError, match='frozen'):
        p.Define('new', 1, '')
    q = p.Copy()
    assert not q.IsImmutable() and not q.inner.IsImmutable()
    q.dim = 3
    assert p.dim == 8


def test_copy_is_deep_and_equal():
    p = _params()
    p.Define('shape', [1, 2], 'A list.')
    p.Define('subs', [_params(), _params()], 'Params list.')
    q = p.Copy()
    assert q == p
    q.inner.rate = 0.1
    q.shape.append(3)
    q.subs[1].dim = 99
    assert p.inner.rate == 0.5 and p.shape == [1, 2] and p.subs[1].dim == 8
    assert q != p


def test_str_is_nested_and_readable():
    text = str(_params())
    assert 'dim: 8' in text and 'inner: {' in text and 'rate: 0.5' in text


def test_to_text_and_back_with_every_value_type():
    p = hyperparams.Params()
    values = dict(
        i=3,
        f=-1.5,
        s='he said "hi"\n',
        b=True,
        n=None,
        lst=[1, 'a', (2.0, None)],
        tup=(3, 4),
        single=(5,),
        d={'k': [1, 2], 'z': None},
        dt=tf.bfloat16,
        cls=layers.FCLayer,
        dts=[tf.float32, tf.int32],
    )
    for k, v in values.items():
        p.Define(k, v, '')
    inner = hyperparams.Params()
    inner.Define('x', 1, '')
    p.Define('inner', inner, '')
    text = p.ToText()
    assert 'dt : tf.bfloat16' in text
    assert 'cls : type/tf_gpipe.layers.fc/FCLayer' in text
    assert 'inner.x : 1' in text
    q = hyperparams.Params()
    for k, v in values.items():
        q.Define(k, type(v)() if isinstance(v, (list, dict)) else None, '')
    inner2 = hyperparams.Params()
    inner2.Define('x', 0, '')
    q.Define('inner', inner2, '')
    q.FromText(text)
    assert q == p
    assert q.ToText() == text
    assert isinstance(q.tup, tuple) and isinstance(q.lst[2], tuple)


def test_from_text_round_trips_layer_params_lists():
    fc = layers.FCLayer.Params().Set(name='fc', input_dim=4, output_dim=3, activation='TANH')
    conv = layers.Conv2DLayer.Params().Set(name='conv', filter_shape=(3, 3, 1, 4))
    inner = layers.SequentialLayer.Params().Set(name='inner', sub=[fc.Copy()])
    seq = layers.SequentialLayer.Params().Set(name='seq', sub=[conv, inner, fc], random_seed=7)
    fresh = layers.SequentialLayer.Params().FromText(seq.ToText())
    assert fresh == seq
    assert isinstance(fresh.sub[1].sub[0], hyperparams.InstantiableParams)
    assert fresh.sub[1].sub[0].cls is layers.FCLayer
    # A shorter list and a changed class in place.
    text = seq.ToText().replace('sub : <list of 3 Params>', 'sub : <list of 2 Params>')
    text = '\n'.join(line for line in text.splitlines() if not line.startswith('sub[2]'))
    shorter = seq.Copy().FromText(text)
    assert len(shorter.sub) == 2 and shorter.sub[1] == inner


def test_from_text_changing_cls_rebuilds_params():
    p = hyperparams.Params()
    p.Define('layer', layers.FCLayer.Params().Set(name='l'), '')
    p.FromText('layer.cls : type/tf_gpipe.layers.dropout/DropoutLayer\nlayer.keep_prob : 0.5')
    assert p.layer.cls is layers.DropoutLayer and p.layer.keep_prob == 0.5
    assert p.layer.name == 'l'


def test_from_text_type_errors_and_typos():
    p = _params()
    with pytest.raises(ValueError, match=r"'dim' expects an int.*'abc'"):
        p.FromText('dim : abc')
    with pytest.raises(ValueError, match="'dim' expects an int"):
        p.FromText('dim : 1.5')
    with pytest.raises(AttributeError, match="did you mean 'rate'"):
        p.FromText('inner.rat : 1.0')
    with pytest.raises(ValueError, match='not of the form'):
        p.FromText('dim 3')
    p.FromText('# a comment\n\ninner.rate : 2\nname : plain_word')
    assert p.inner.rate == 2.0 and isinstance(p.inner.rate, float)
    assert p.name == 'plain_word'


def test_apply_overrides():
    p = hyperparams.Params()
    p.Define('task', _params(), '')
    p.Define('train', _params(), '')
    hyperparams.apply_overrides(p, 'task.dim=4; train.inner.steps = 64 ;task.name="a b"')
    assert p.task.dim == 4 and p.train.inner.steps == 64 and p.task.name == 'a b'
    with pytest.raises(AttributeError, match="did you mean 'steps'"):
        hyperparams.apply_overrides(p, 'train.inner.stepz=3')
    with pytest.raises(ValueError, match="'task.dim' expects an int"):
        hyperparams.apply_overrides(p, 'task.dim=many')
    with pytest.raises(ValueError, match="form 'name=value'"):
        hyperparams.apply_overrides(p, 'task.dim')


def test_text_diff():
    a, b = _params(), _params()
    b.dim = 9
    assert hyperparams.TextDiff(a, b) == '- dim : 8\n+ dim : 9\n'
    assert hyperparams.TextDiff(a, a.Copy()) == ''


def test_instantiable_params():
    p = hyperparams.InstantiableParams(_Thing)
    p.Define('x', 1, '')
    thing = p.Instantiate(extra=5)
    assert isinstance(thing, _Thing) and thing.params.x == 1 and thing.extra == 5
    assert isinstance(p.Copy(), hyperparams.InstantiableParams)
    with pytest.raises(ValueError, match='cls is not set'):
        hyperparams.InstantiableParams().Instantiate()


def test_aliases_accept_old_names_with_a_deprecation_warning(caplog):
    inner = hyperparams.Params()
    inner.Define('steps', 1, '')
    loop = hyperparams.Params()
    loop.Define('max_steps', 10, '')
    p = hyperparams.Params()
    p.Define('train', loop, '')
    p.Define('eval', inner, '')
    p.Define('opt', hyperparams.Params().Define('lr', 0.1, '') or None, '')
    p.DefineAlias('train.eval_steps', 'eval.steps')
    p.DefineAlias('old_train', 'train')
    with caplog.at_level('WARNING'):
        p.Set(**{'train.eval_steps': 5})
        assert p.eval.steps == 5 and p.Get('train.eval_steps') == 5
        hyperparams.apply_overrides(p, 'train.eval_steps=6; old_train.max_steps=7')
        assert p.eval.steps == 6 and p.train.max_steps == 7
        p.old_train.max_steps = 8  # attribute access through a same-level alias
        assert p.train.max_steps == 8
    messages = [r.getMessage() for r in caplog.records]
    assert (
        "Parameter 'train.eval_steps' is deprecated; use 'eval.steps' (Lingvo's tree)." in messages
    )
    assert any("'old_train' is deprecated; use 'train'" in m for m in messages)
    # Aliases are not fields: the text form has only the new names, and survives Copy().
    assert 'eval_steps' not in p.ToText() and 'old_train' not in p.ToText()
    assert p.Copy().Get('train.eval_steps') == 6
    # A moved name, reached as an attribute of the nested params, says where it went.
    with pytest.raises(AttributeError, match="'eval_steps': it moved to 'eval.steps'"):
        p.train.eval_steps = 3


class _UsersLayer(layers.FCLayer):
    """A user's layer, defined in a module a params file imported."""


def test_params_text_names_only_tf_gpipe_classes_and_imports_nothing(tmp_path, monkeypatch):
    p = hyperparams.Params()
    p.Define('cls', layers.FCLayer, '')
    # A user's subclass of a tf_gpipe class, in a module already loaded: read back as written.
    p.FromText(f'cls : type/{__name__}/_UsersLayer')
    assert p.cls is _UsersLayer
    refused = 'is not a class of tf_gpipe'
    # Anything else is refused: a function, a class of another library (loaded or not).
    for text in ('type/os/system', 'type/subprocess/Popen', f'type/{__name__}/_Thing'):
        with pytest.raises(ValueError, match=refused):
            p.FromText(f'cls : {text}')
        with pytest.raises(ValueError, match=refused):
            hyperparams.apply_overrides(p, f'cls={text}')
    # A module that is not loaded is never imported: its code does not run.
    (tmp_path / 'planted.py').write_text(f'open({str(tmp_path / "ran")!r}, "w").close()\nX = 1\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=refused):
        p.FromText('cls : type/planted/X')
    assert not (tmp_path / 'ran').exists()
    assert p.cls is _UsersLayer
