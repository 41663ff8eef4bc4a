"""Every registered model's params: inspect_model works without building the model, and the
parameter count it reports matches what the config implies."""

import os

import pytest

from tf_gpipe import model_registry
from tf_gpipe.trainer import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))


def _lm_params(p):
    d, h, v = p.model_dim, p.layer_tpl.hidden_dim or 4 * p.model_dim, p.vocab_size
    per_layer = 4 * d * d + 4 * d + 2 * 2 * d + d * h + h + h * d + d
    return v * d + p.num_layers * per_layer + 2 * d + d * v + v


def _mt_params(p):
    d, h, v = p.model_dim, p.layer_tpl.hidden_dim or 4 * p.model_dim, p.vocab_size
    encoder_layer = 4 * d * d + 4 * d + 2 * 2 * d + d * h + h + h * d + d
    decoder_layer = encoder_layer + 4 * d * d + 4 * d + 2 * d
    return (
        v * d
        + p.num_encoder_layers * encoder_layer
        + v * d
        + 2 * d
        + p.num_decoder_layers * decoder_layer
        + 2 * d
        + d * v
        + v
    )


@pytest.mark.parametrize('key', model_registry.GetAllRegisteredKeys())
def test_inspect_model_without_building(key):
    task_p, input_p = model_registry.GetParams(key)
    table, total = trainer.InspectModel(task_p, input_p)
    assert f'total parameters: {total:,}' in table
    if key.startswith('lm.'):
        assert total == _lm_params(task_p)
    if key.startswith('mt.'):
        assert total == _mt_params(task_p)
    assert len(table.splitlines()) == task_p.pipeline.num_partitions + 4


def test_paper_scale_lm_is_large():
    task_p, _ = model_registry.GetParams('lm.lm1b.TransformerLmPaper')
    _, total = trainer.InspectModel(task_p)
    assert 1.2e9 < total < 1.4e9


@pytest.mark.parametrize(
    'key,paper',
    [('image.imagenet.AmoebaNetD', 82e6), ('image.imagenet.AmoebaNetDLarge', 318e6)],
)
def test_registered_amoebanet_has_the_papers_size(key, paper):
    """GPipe paper, Table 1: AmoebaNet-D (18, 208) has 82M parameters, (18, 416) 318M."""
    task_p, input_p = model_registry.GetParams(key)
    _, total = trainer.InspectModel(task_p, input_p)
    assert abs(total / paper - 1) < 0.02, total


def test_inspect_model_memory_follows_the_optimizer():
    """param+opt MB counts weights, gradient sums and the optimizer's slots: adam 2, sgd 0."""
    task_p, input_p = model_registry.GetParams('lm.synthetic.TransformerLmTiny')
    column = {}
    for optimizer in ('adam', 'sgd', 'momentum'):
        task_p.train.learner.optimizer = optimizer
        table, total = trainer.InspectModel(task_p, input_p)
        rows = table.splitlines()[2 : 2 + task_p.pipeline.num_partitions]
        column[optimizer] = sum(float(r.split()[-2]) for r in rows)
        assert f'{optimizer} slot(s) per parameter' in table
    assert column['adam'] / column['sgd'] == pytest.approx(2.0, rel=0.02)
    assert column['momentum'] / column['sgd'] == pytest.approx(1.5, rel=0.02)
