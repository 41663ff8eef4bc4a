"""trainer.checks: every bad loop, learner and pipeline value is refused before any work, all at
once, by its full name."""

import os

import pytest

from tf_gpipe import hyperparams, model_registry
from tf_gpipe.trainer import checks, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = 'lm.synthetic.TransformerLmTiny'


def _task(overrides=''):
    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    model = model_registry.GetClass(MODEL)()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    hyperparams.apply_overrides(p, overrides)
    return p


def test_the_demo_model_passes():
    checks.CheckParams(_task().task)


@pytest.mark.parametrize(
    'override,message',
    [
        ('task.train.max_steps=-5', 'task.train.max_steps=-5 must be int >= 0'),
        ('task.train.log_interval_steps=0', 'task.train.log_interval_steps=0 must be int >= 1'),
        ('task.train.save_interval_steps=0', 'task.train.save_interval_steps=0 must be int >= 1'),
        (
            'task.train.learner.learning_rate=1e999',
            'task.train.learner.learning_rate=inf must be a finite',
        ),
        (
            'task.train.learner.learning_rate=-0.1',
            'task.train.learner.learning_rate=-0.1 must be a finite',
        ),
        (
            'task.train.learner.learning_rate=nan',
            'task.train.learner.learning_rate=nan must be a finite number > 0',
        ),
        ('task.train.learner.epsilon=-inf', 'task.train.learner.epsilon=-inf must be a finite'),
        ('task.train.learner.beta2=1.0', r'task.train.learner.beta2=1.0 must be in \[0, 1\)'),
        ('task.pipeline.num_micro_batches=0', 'task.pipeline.num_micro_batches=0 must be int'),
        ('task.pipeline.recompute=sometimes', "Unknown recompute 'sometimes'"),
        ('task.pipeline.schedule=1fb1', "Unknown schedule '1fb1' \\(did you mean '1f1b'"),
        ('task.fprop_dtype=tf.int32', 'task.fprop_dtype=tf.int32 must be a floating dtype'),
        ('task.dtype=tf.int64', 'task.dtype=tf.int64 must be a floating dtype'),
    ],
)
def test_a_bad_value_is_named(override, message):
    with pytest.raises(ValueError, match=message):
        checks.CheckParams(_task(override).task)


def test_every_problem_at_once_before_the_logdir_is_made(tmp_path):
    p = _task('task.train.max_steps=-5; task.train.log_interval_steps=0')
    with pytest.raises(ValueError, match=r'Bad params \(2\)') as info:
        trainer.Trainer(p, str(tmp_path / 'run')).Build()
    assert 'max_steps=-5' in str(info.value) and 'log_interval_steps=0' in str(info.value)
    assert not (tmp_path / 'run').exists()


def test_inspect_model_checks_too():
    p = _task('task.pipeline.num_micro_batches=0; task.pipeline.recompute=sometimes')
    with pytest.raises(ValueError, match=r'Bad params \(2\)'):
        trainer.InspectModel(p.task, p.input)


def test_a_nan_set_in_a_params_file_is_named():
    p = _task()
    p.task.train.learner.learning_rate = float('nan')  # as a params file's Task() could set it
    with pytest.raises(ValueError, match='task.train.learner.learning_rate=nan must be a finite'):
        checks.CheckParams(p.task)


def test_every_registered_model_passes():
    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    built_in = [
        k for k in model_registry.GetAllRegisteredKeys() if k.startswith(('lm.', 'mt.', 'image.'))
    ]
    assert len(built_in) >= 5, built_in
    for key in built_in:
        checks.CheckParams(model_registry.GetClass(key)().Task())


def test_a_missing_warm_start_checkpoint_is_named_before_the_logdir_is_made(tmp_path):
    p = _task()
    missing = str(tmp_path / 'old' / 'ckpt-5')
    p.task.train.init_from_checkpoint_rules = {missing: ([('(.*)', '%s')], [])}
    with pytest.raises(ValueError, match=rf'is not a checkpoint \(no {missing}.index\)'):
        trainer.Trainer(p, str(tmp_path / 'run')).Build()
    assert not (tmp_path / 'run').exists()


def test_ids_beyond_the_embedding_are_named_before_any_work(tmp_path):
    """A vocabulary larger than the embedding: on a CPU the lookup would fail inside its cell
    and the pipeline's other cells report only 'RecvAsync is cancelled'."""
    p = _task('input.vocab_size=80; test.vocab_size=70')
    with pytest.raises(ValueError, match=r'Bad params \(2\)') as info:
        trainer.Trainer(p, str(tmp_path / 'run')).Build()
    assert 'input.vocab_size=80 is larger than task.vocab_size=64: ids 64..79' in str(info.value)
    assert 'test.vocab_size=70' in str(info.value) and 'Set task.vocab_size >= 70' in str(
        info.value
    )
    assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize(
    'override,message',
    [
        ('input.seq_len=0', 'input.seq_len=0 must be int >= 1'),
        ('input.max_stride=0', 'input.max_stride=0 must be int >= 1'),
        ('test.batch_size=-2', 'test.batch_size=-2 must be int >= 1'),
    ],
)
def test_input_sizes_are_checked_with_the_rest(override, message):
    p = _task(override)
    with pytest.raises(ValueError, match=message):
        checks.CheckParams(p.task, {'input': p.input, 'test': p.test})


def test_inspect_model_checks_the_input_too():
    p = _task('input.seq_len=0')
    with pytest.raises(ValueError, match='input.seq_len=0 must be int >= 1'):
        trainer.InspectModel(p.task, p.input)
