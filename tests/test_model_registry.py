"""Model registry: keys from params/<task>/<file>.py, did-you-mean, user params dirs."""

import os

import pytest

from tf_gpipe import model_registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_USER_FILE = """
from tf_gpipe import base_model_params, inputs, model_registry, tasks


@model_registry.RegisterSingleTaskModel
class MyLm(base_model_params.SingleTaskModelParams):
    def Train(self):
        return inputs.SyntheticLm.Params().Set(batch_size=8)

    def Task(self):
        return tasks.LanguageModel.Params().Set(name='lm', vocab_size=8, model_dim=8)
"""


def test_checkout_params_and_user_dir(tmp_path):
    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    assert 'lm.synthetic.TransformerLmTiny' in model_registry.GetAllRegisteredKeys()
    (tmp_path / 'mytask').mkdir()
    (tmp_path / 'mytask' / 'experiments.py').write_text(_USER_FILE)
    model_registry.LoadParamsDir(str(tmp_path))
    model_registry.LoadParamsDir(str(tmp_path))  # idempotent
    task_p, input_p = model_registry.GetParams('mytask.experiments.MyLm', 'Test')
    assert task_p.vocab_size == 8 and input_p.batch_size == 8  # Test() defaults to Train()


def test_unknown_key_names_the_closest():
    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    with pytest.raises(LookupError, match="Did you mean 'lm.synthetic.TransformerLmTiny'"):
        model_registry.GetClass('lm.synthetic.TransformerLMTiny')
    with pytest.raises(FileNotFoundError, match='does not exist'):
        model_registry.LoadParamsDir('/nonexistent/params')


def test_only_model_params_classes_register():
    with pytest.raises(TypeError, match='not a SingleTaskModelParams subclass'):
        model_registry.RegisterSingleTaskModel(object)


def test_a_user_file_at_a_built_in_path_loads_beside_it(tmp_path):
    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    (tmp_path / 'lm').mkdir()
    (tmp_path / 'lm' / 'synthetic.py').write_text(_USER_FILE.replace('MyLm', 'MyOtherLm'))
    model_registry.LoadParamsDir(str(tmp_path))
    keys = model_registry.GetAllRegisteredKeys()
    assert 'lm.synthetic.MyOtherLm' in keys and 'lm.synthetic.TransformerLmTiny' in keys


def test_a_key_defined_twice_names_both_files(tmp_path):
    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    (tmp_path / 'lm').mkdir()
    user = tmp_path / 'lm' / 'synthetic.py'
    user.write_text(_USER_FILE.replace('MyLm', 'TransformerLmTiny'))
    builtin = os.path.join(ROOT, 'params', 'lm', 'synthetic.py')
    with pytest.raises(ValueError, match='lm.synthetic.TransformerLmTiny is defined twice') as e:
        model_registry.LoadParamsDir(str(tmp_path))
    assert builtin in str(e.value) and str(user) in str(e.value)
    assert model_registry._SOURCES['lm.synthetic.TransformerLmTiny'] == builtin  # untouched
    # Twice in one file: the same error, naming the file.
    other = tmp_path / 'other'
    (other / 'mytask').mkdir(parents=True)
    (other / 'mytask' / 'dup.py').write_text(_USER_FILE + _USER_FILE.split('\n', 2)[2])
    with pytest.raises(ValueError, match=r'mytask.dup.MyLm is defined twice: in .*dup.py\.'):
        model_registry.LoadParamsDir(str(other))


def test_an_error_inside_a_params_file_names_the_file_and_line(tmp_path):
    (tmp_path / 'typo').mkdir()
    path = tmp_path / 'typo' / 'exp.py'
    path.write_text(
        _USER_FILE.replace('class MyLm', 'class TypoLm').replace(
            "        return tasks.LanguageModel.Params().Set(name='lm', vocab_size=8, model_dim=8)",
            "        p = tasks.LanguageModel.Params().Set(name='lm', vocab_size=8)\n"
            '        p.train.max_stepz = 5\n'
            '        return p',
        )
    )
    model_registry.LoadParamsDir(str(tmp_path))
    line = path.read_text().splitlines().index('        p.train.max_stepz = 5') + 1
    with pytest.raises(AttributeError) as e:
        model_registry.GetParams('typo.exp.TypoLm')
    assert str(e.value) == (
        f"{path}, line {line}, in TypoLm.Task: Params has no parameter 'max_stepz' "
        "(did you mean 'max_steps'?); Define() it first."
    )


def test_a_broken_params_file_blocks_only_its_own_models(tmp_path):
    """A syntax error in one file of a params directory: the other files' models load; asking
    for a missing key names the broken file, its line and the error."""
    (tmp_path / 'mine').mkdir()
    (tmp_path / 'mine' / 'good.py').write_text(_USER_FILE.replace('MyLm', 'GoodLm'))
    broken = tmp_path / 'mine' / 'broken.py'
    broken.write_text(_USER_FILE.replace('MyLm', 'BrokenLm') + '\ndef oops(:\n')
    model_registry.LoadParamsDir(str(tmp_path))
    assert model_registry.GetClass('mine.good.GoodLm').__name__ == 'GoodLm'
    line = broken.read_text().splitlines().index('def oops(:') + 1
    assert model_registry.BrokenFiles()[str(broken)].startswith(f'line {line}: SyntaxError')
    with pytest.raises(LookupError, match=rf'{broken} failed to load: line {line}: SyntaxError'):
        model_registry.GetClass('mine.broken.BrokenLm')
    broken.write_text(_USER_FILE.replace('MyLm', 'BrokenLm'))  # fixed: loads the next time
    model_registry.LoadParamsDir(str(tmp_path))
    assert model_registry.GetClass('mine.broken.BrokenLm').__name__ == 'BrokenLm'
    assert str(broken) not in model_registry.BrokenFiles()
