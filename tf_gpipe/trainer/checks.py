"""Every training, loop and pipeline value checked before any work starts.

`CheckParams(p)` runs in train, eval and inspect alike, and reports every bad value at once,
each with its full name and what would be accepted, instead of letting one reach a step (a
negative `max_steps` that "trains" to -5, an interval of 0 that divides by zero, a NaN
learning rate applied once before the divergence check).
"""

import difflib
import math

import tensorflow as tf

from tf_gpipe.gpipe import RECOMPUTE_POLICIES, schedules
from tf_gpipe.trainer import checkpoints


def _at_least(problems, name, value, low, kind=int):
    if not isinstance(value, kind) or isinstance(value, bool) or value < low:
        problems.append(f'{name}={value!r} must be {kind.__name__} >= {low}')


def _positive_number(problems, name, value, allow_zero=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        problems.append(f'{name}={value!r} must be a finite number {">=" if allow_zero else ">"} 0')


def _dtype_name(value):
    return f'tf.{value.name}' if isinstance(value, tf.dtypes.DType) else repr(value)


def _is_rule(rule):
    if not isinstance(rule, (list, tuple)) or len(rule) != 2:
        return False
    mappings, ignores = rule
    pairs = all(
        isinstance(m, (list, tuple)) and len(m) == 2 and all(isinstance(x, str) for x in m)
        for m in mappings
    )
    return pairs and all(isinstance(i, str) for i in ignores)


def _problems(task_p):
    problems = []
    train = task_p.train
    _at_least(problems, 'task.train.max_steps', train.max_steps, 0)
    for name in (
        'log_interval_steps',
        'save_interval_steps',
        'max_checkpoints_to_keep',
    ):
        _at_least(problems, f'task.train.{name}', train.Get(name), 1)
    _at_least(problems, 'task.train.trace_interval_steps', train.trace_interval_steps, 0)
    for name in ('interval_steps', 'steps'):
        _at_least(problems, f'task.eval.{name}', task_p.eval.Get(name), 1)
    rules = train.init_from_checkpoint_rules
    if not isinstance(rules, dict) or not all(_is_rule(r) for r in rules.values()):
        problems.append(
            f'task.train.init_from_checkpoint_rules={rules!r} must be {{checkpoint path: '
            "([(regex, format)], [ignore regex])}, e.g. {'/old/ckpt-100': "
            "([('task/network/(.*)', 'task/network/%s')], [])}"
        )
    else:
        for path in rules:
            try:
                checkpoints.Resolve(path)
            except FileNotFoundError as e:
                problems.append(f'task.train.init_from_checkpoint_rules: {e}')
    learner = train.learner
    _positive_number(problems, 'task.train.learner.learning_rate', learner.learning_rate)
    _positive_number(problems, 'task.train.learner.epsilon', learner.epsilon)
    for name in ('clip_gradient_norm', 'l2_regularizer_weight'):
        _positive_number(problems, f'task.train.learner.{name}', learner.Get(name), allow_zero=True)
    for name in ('warmup_steps', 'total_steps'):
        _at_least(problems, f'task.train.learner.{name}', learner.Get(name), 0)
    for name in ('beta1', 'beta2', 'momentum'):
        value = learner.Get(name)
        if not isinstance(value, (int, float)) or not 0 <= value < 1:
            problems.append(f'task.train.learner.{name}={value!r} must be in [0, 1)')
    for name in ('dtype', 'fprop_dtype'):
        value = task_p.Get(name)
        if name == 'fprop_dtype' and value is None:
            continue  # the activations take `dtype`
        if not isinstance(value, tf.dtypes.DType) or not value.is_floating:
            problems.append(
                f'task.{name}={_dtype_name(value)} must be a floating dtype (tf.float32, '
                'tf.bfloat16 or tf.float16): weights, activations and gradients are floats '
                '(an integer model has no gradient, so it would never train)'
            )
    pipe = task_p.pipeline
    for name in ('num_partitions', 'num_micro_batches', 'virtual_stages', 'num_replicas'):
        _at_least(problems, f'task.pipeline.{name}', pipe.Get(name), 1)
    for name, allowed in (('recompute', RECOMPUTE_POLICIES), ('schedule', schedules.SCHEDULES)):
        value = pipe.Get(name)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), allowed, n=1)
            hint = f' (did you mean {close[0]!r}?)' if close else ''
            problems.append(
                f'Unknown {name} {value!r}{hint}: task.pipeline.{name} is one of {allowed}'
            )
    return problems


def CheckParams(task_p, inputs=None):
    """Raises one ValueError that lists every bad value of the task's loop, learner and
    pipeline settings, and of `inputs` ({root name: input params}) against the task (nothing
    is built)."""
    problems = _problems(task_p)
    for name, input_p in (inputs or {}).items():
        problems += _input_problems(task_p, name, input_p)
    if problems:
        lines = '\n  '.join(problems)
        raise ValueError(f'Bad params ({len(problems)}):\n  {lines}\nFix them and run again.')


# Input sizes that must be positive (a zero length or stride makes an empty or constant batch
# that fails deep inside the first step).
_POSITIVE_INPUT = ('batch_size', 'seq_len', 'vocab_size', 'max_stride', 'min_len', 'image_size')


def _input_problems(task_p, name, input_p):
    """Sizes of an input that cannot make a batch, and ids that outrun the task's vocabulary
    (on a CPU the embedding lookup fails in its cell, and the pipeline's other cells report
    only 'RecvAsync is cancelled')."""
    if input_p is None:
        return []
    problems = []
    for size in _POSITIVE_INPUT:
        if size in input_p:
            _at_least(problems, f'{name}.{size}', input_p.Get(size), 1)
    if 'min_len' in input_p and 'seq_len' in input_p:
        low, high = input_p.min_len, input_p.seq_len
        if isinstance(low, int) and isinstance(high, int) and 1 <= high < low:
            problems.append(f'{name}.min_len={low} must be <= {name}.seq_len={high}')
    if 'vocab_size' not in input_p or 'vocab_size' not in task_p:
        return problems
    given, rows = input_p.vocab_size, task_p.vocab_size
    if isinstance(given, int) and isinstance(rows, int) and 0 < rows < given:
        problems.append(
            f'{name}.vocab_size={given} is larger than task.vocab_size={rows}: ids {rows}..'
            f'{given - 1} have no embedding row. Set task.vocab_size >= {given} (or '
            f'{name}.vocab_size <= {rows}).'
        )
    return problems
