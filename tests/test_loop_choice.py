"""loop_choice.py: which calls run as loops, and a log line once per reason when one cannot."""

import pytest
import tensorflow as tf

from tf_gpipe import fprop_context, gpipe, layers
from tf_gpipe.gpipe import loop_choice


def _pipe(m=2, **kw):
    fc = layers.FCLayer.Params().Set(input_dim=3, output_dim=3)
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            sub=[fc.Copy().Set(name=f'fc{i}') for i in range(2)],
            num_partitions=2,
            partition_by='uniform',
            num_micro_batches=m,
            **kw,
        )
        .Instantiate()
    )


def test_params_decide_and_one_micro_batch_needs_no_loop():
    p = gpipe.PipelinedLayer.Params().Set(name='pipe', tick_loop=False, eval_loop=False)
    choice = loop_choice.LoopChoice(p)
    assert choice.Eval(None, None, [1, 2], None, 0) is None  # asked for neither: not looked at
    assert choice.FillDrain(None, None, [1, 2], None, 0) is None
    p.Set(tick_loop=True, eval_loop=True)
    assert choice.Eval(None, None, [1], None, 0) is None  # M=1: nothing to loop over
    assert choice.FillDrain(None, None, [1], None, 0) is None


def test_each_reason_is_logged_once_per_param(caplog):
    pipe = _pipe(tick_loop=True)
    uneven = tf.ones([5, 3])  # M=2: 3 and 2 examples

    @tf.function(autograph=False)
    def steps(x):
        with fprop_context.eval_mode():
            a = pipe.FProp(x)
            b = pipe.FProp(x * 2.0)
        with tf.GradientTape() as tape:
            c = tf.reduce_sum(pipe.FProp(x))
        return a, b, tape.gradient(c, pipe.trainable_variables)

    steps(uneven)
    lines = [r.getMessage() for r in caplog.records if 'runs unrolled' in r.getMessage()]
    assert lines == [
        'pipe: eval_loop=None (auto), but this call runs unrolled (its program grows with M): '
        'micro-batches of different sizes.',
        'pipe: tick_loop=True, but this call runs unrolled (its program grows with M): '
        'micro-batches of different sizes.',
    ], lines


def test_devices_of_several_tf_tasks_span_processes():
    local = ['/device:CPU:0', '/job:localhost/replica:0/task:0/device:CPU:1', None]
    assert not loop_choice.spans_tasks(local)  # logical devices of this process
    assert not loop_choice.spans_tasks(['/job:worker/task:1/device:CPU:0'] * 2)
    assert loop_choice.spans_tasks(
        ['/job:worker/replica:0/task:0/device:CPU:0', '/job:worker/replica:0/task:1/device:CPU:0']
    )
    assert loop_choice.spans_tasks(['/device:CPU:0', '/job:worker/task:0/device:GPU:0'])


def test_eval_across_tasks_runs_unrolled_by_default(caplog):
    class Runner:
        def __init__(self, task):
            self.device = f'/job:worker/replica:0/task:{task}/device:CPU:0'

    p = gpipe.PipelinedLayer.Params().Set(name='pipe')  # eval_loop=None: auto
    choice = loop_choice.LoopChoice(p)
    # absl's own logger level too: an earlier test in the process may have pinned it.
    with tf.Graph().as_default(), caplog.at_level('INFO'), caplog.at_level('INFO', 'absl'):
        micro = [tf.ones([2, 3]), tf.ones([2, 3])]
        assert choice.Eval([Runner(0), Runner(1)], None, micro, None, 0) is None
    lines = [r.getMessage() for r in caplog.records if 'TF task' in r.getMessage()]
    assert lines == [
        'pipe: eval_loop=None (auto), but this call runs unrolled (its program grows with M): '
        'its cells are on more than one TF task (each tick would cross processes).'
    ]
    assert [r.levelname for r in caplog.records if 'TF task' in r.getMessage()] == ['INFO']


def test_the_default_trains_by_loops_from_auto_min_micro_batches_in_one_process(caplog):
    """tick_loop=None: fewer micro-batches run unrolled without a word; from the threshold on
    the step is a tick loop (one While op, whatever M)."""
    a = loop_choice.AUTO_MIN_MICRO_BATCHES

    def whiles(m):
        pipe = _pipe(m=m, schedule='1f1b')
        x = tf.ones([2 * m, 3])
        graph = (
            tf.function(lambda: pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y)))
            .get_concrete_function()
            .graph
        )
        return sum(op.type in ('While', 'StatelessWhile') for op in graph.get_operations())

    with caplog.at_level('INFO'), caplog.at_level('INFO', 'absl'):
        assert whiles(a - 1) == 0
        assert whiles(a) == whiles(2 * a) == 1
    assert not [r for r in caplog.records if 'runs unrolled' in r.getMessage()]


def test_training_across_tasks_runs_unrolled_by_default_and_says_so_at_info(caplog):
    class Runner:
        def __init__(self, task):
            self.device = f'/job:worker/replica:0/task:{task}/device:CPU:0'

    class Run:
        runners = [Runner(0), Runner(1)]
        sched = None

    choice = loop_choice.LoopChoice(gpipe.PipelinedLayer.Params().Set(name='pipe'))
    micro = [tf.ones([2, 3])] * loop_choice.AUTO_MIN_MICRO_BATCHES
    with tf.Graph().as_default(), caplog.at_level('INFO'), caplog.at_level('INFO', 'absl'):
        assert choice.Ticks(Run(), [(m,) for m in micro], None, False) is False
    lines = [r for r in caplog.records if 'TF task' in r.getMessage()]
    assert [r.getMessage() for r in lines] == [
        'pipe: tick_loop=None (auto), but this call runs unrolled (its program grows with M): '
        'its cells are on more than one TF task (each tick would cross processes).'
    ]
    assert [r.levelname for r in lines] == ['INFO']


@pytest.mark.parametrize('name', ['tick_loop', 'eval_loop'])
def test_a_loop_param_is_none_true_or_false(name):
    with pytest.raises(
        ValueError, match=f"{name} must be None \\(auto\\), True or False, got 'yes'"
    ):
        _pipe(**{name: 'yes'})
