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
