"""Each tiny model trains in-process for a few steps through the Trainer: the loss falls."""

import os

import pytest

from tf_gpipe import hyperparams, model_registry
from tf_gpipe.trainer import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))


@pytest.mark.parametrize(
    'key,steps', [('lm.synthetic.TransformerLmTiny', 40), ('mt.synthetic.TransformerNmtTiny', 60)]
)
def test_tiny_model_learns(key, steps, tmp_path):
    model = model_registry.GetClass(key)()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    hyperparams.apply_overrides(
        p, f'task.train.max_steps={steps}; task.train.log_interval_steps={steps // 2}'
    )
    t = trainer.Trainer(p, str(tmp_path))
    t.Build()
    first = float(t._train_step().metrics.loss)
    last = t.Train()
    assert last['loss'] < 0.6 * first, (first, last)
    assert t.Evaluate()['accuracy'] > 0.2


def test_bfloat16_compute_through_the_trainer(tmp_path):
    model = model_registry.GetClass('lm.synthetic.TransformerLmTiny')()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    hyperparams.apply_overrides(
        p, 'task.fprop_dtype=tf.bfloat16; task.train.max_steps=30; task.train.log_interval_steps=15'
    )
    t = trainer.Trainer(p, str(tmp_path))
    t.Build()
    layer = t.task.network.cells[1].sub[0]
    assert layer.fprop_dtype.name == 'bfloat16' and layer.atten.vars.w_query.dtype.name == 'float32'
    first = float(t._train_step().metrics.loss)
    assert t.Train()['loss'] < 0.8 * first
