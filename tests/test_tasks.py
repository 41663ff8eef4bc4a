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
        p,
        f'task.train.max_steps={steps}; task.train.log_interval_steps={steps // 2}; '
        'task.pipeline.num_micro_batches=2',  # M does not change the maths, only the tracing
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
        p,
        'task.fprop_dtype=tf.bfloat16; task.train.max_steps=30; task.train.log_interval_steps=15; '
        'task.pipeline.num_micro_batches=2',
    )
    t = trainer.Trainer(p, str(tmp_path))
    t.Build()
    layer = t.task.network.cells[1].sub[0]
    assert layer.fprop_dtype.name == 'bfloat16' and layer.atten.vars.w_query.dtype.name == 'float32'
    first = float(t._train_step().metrics.loss)
    assert t.Train()['loss'] < 0.8 * first


def _task_gradients(key, overrides, padded):
    import numpy as np
    import tensorflow as tf

    from tf_gpipe import fprop_context

    model = model_registry.GetClass(key)()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    hyperparams.apply_overrides(p, 'input.batch_size=7; task.random_seed=7; ' + overrides)
    task = p.task.Instantiate()
    batch = p.input.Instantiate().GetBatch(tf.constant(3, tf.int64))
    if padded:  # token weights that differ between examples: the mean is over tokens
        batch.weights = batch.weights * tf.cast(
            tf.sequence_mask(tf.range(7) % 5 + 3, tf.shape(batch.weights)[1]), tf.float32
        )
    with fprop_context.scope(step=3):
        out, grads = task.ComputeGradients(batch)
        if 'gpipe' in overrides:
            with tf.GradientTape() as tape:  # fill-drain under a tape, the whole batch's loss
                ref = task.FPropTower(batch).loss
    names = [v.name for v in task.network.trainable_variables]
    if 'gpipe' in overrides:
        want = [
            tf.convert_to_tensor(g) for g in tape.gradient(ref, task.network.trainable_variables)
        ]
        np.testing.assert_allclose(out.loss, ref, rtol=1e-5)
    else:
        want = None
    return out.loss, dict(zip(names, [tf.convert_to_tensor(g) for g in grads])), want, names


@pytest.mark.parametrize(
    'key', ['lm.synthetic.TransformerLmTiny', 'mt.synthetic.TransformerNmtTiny']
)
def test_every_schedule_gives_the_token_weighted_loss_and_gradients(key):
    """The task's micro-batch loss is a token mean weighted by tokens: every schedule (and an
    uneven M=3 on 7 examples) gives the full batch's loss and gradients, with padding and a
    softmax tied to an embedding in another cell."""
    import numpy as np

    smaller = {  # the fewest layers that still make K=4 cells: what is checked is the weighting
        'lm.synthetic.TransformerLmTiny': 'task.num_layers=2; ',
        'mt.synthetic.TransformerNmtTiny': 'task.num_encoder_layers=1; task.num_decoder_layers=1; ',
    }[key]
    base = smaller + (
        'task.pipeline.num_micro_batches=3; task.pipeline.recompute=except_last; '
        'task.tie_embedding=True; '  # the softmax reads the first cells' embedding
    )
    loss, want, tape_grads, names = _task_gradients(
        key, base + 'task.pipeline.schedule=gpipe', True
    )
    scale = max(float(np.abs(g).max()) for g in want.values())
    for name, g in zip(names, tape_grads):
        np.testing.assert_allclose(want[name], g, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
    for schedule in ('1f1b', 'zero_bubble'):
        got_loss, got, _, _ = _task_gradients(
            key, base + f'task.pipeline.schedule={schedule}', True
        )
        np.testing.assert_allclose(got_loss, loss, rtol=1e-5)
        for name in names:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5 * scale)


def test_trainer_runs_a_schedule_from_an_override(tmp_path):
    model = model_registry.GetClass('lm.synthetic.TransformerLmTiny')()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    hyperparams.apply_overrides(
        p,
        'task.pipeline.schedule=interleaved_1f1b; task.pipeline.virtual_stages=2; '
        'task.pipeline.num_partitions=2; task.pipeline.num_micro_batches=2; '
        'task.train.max_steps=30; task.train.log_interval_steps=15',
    )
    t = trainer.Trainer(p, str(tmp_path))
    t.Build()
    assert t.task.network.num_cells == 4 and len(t.task.network.devices) == 2
    first = float(t._train_step().metrics.loss)
    assert t.Train()['loss'] < 0.8 * first
