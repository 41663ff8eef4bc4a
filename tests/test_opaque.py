"""opaque.py: Grappler makes no copy of a cell's function per micro-batch at the first run.

Counted, not timed, from Grappler's own log in a fresh process (function_optimizer's VLOG):
the copies it specialises for the step's calls are as many at M=2 as at M=6, for each
schedule and policy, eval's forward and gpipe's FProp under a tape, with a batch of constants
(a batch of ones cut into M was one of the causes). With `opaque` replaced by the identity the
count grows with M: the control that shows the log is read right.
"""

import os
import re
import subprocess
import sys

import tensorflow as tf

from tf_gpipe.gpipe import opaque

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process runs every case twice (M=2, M=6) and prints a marker before each first call.
SCRIPT = r"""
import sys
from tf_gpipe.runtime import cluster
cluster.logical_cpus(2)
import tensorflow as tf
from tf_gpipe import fprop_context, gpipe, layers
from tf_gpipe.gpipe import executor, recompute

if sys.argv[1] == 'identity':  # the control: opaque does nothing
    executor.opaque = recompute.opaque = lambda structure: structure


def pipe(m, schedule, policy):
    fc = layers.FCLayer.Params().Set(input_dim=4, output_dim=4, activation='TANH')
    return gpipe.PipelinedLayer.Params().Set(
        name='pipe', sub=[fc.Copy().Set(name=f'fc{i}') for i in range(4)], num_partitions=2,
        partition_by='uniform', num_micro_batches=m, recompute=policy, schedule=schedule,
        virtual_stages=2 if schedule == 'interleaved_1f1b' else 1, tick_loop=False,
        eval_loop=False).Instantiate()


def loss_fn(y, weights):  # the weights: a constant batch of ones, cut into M micro-batches
    return tf.reduce_sum(tf.reduce_mean(y * y, 1) * weights) / tf.reduce_sum(weights)


def run(case, m):
    schedule, policy = case.split(':')
    p = pipe(m, 'gpipe' if schedule in ('eval', 'fprop') else schedule, policy)

    @tf.function(autograph=False)
    def step():
        x = tf.ones([2 * m, 4])
        if schedule == 'eval':
            with fprop_context.eval_mode():
                return p.FProp(x)
        if schedule == 'fprop':
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(p.FProp(x))
            return tape.gradient(loss, p.trainable_variables)
        return p.ComputeGradients(x, tf.ones([2 * m]), loss_fn)

    step.get_concrete_function()
    print(f'CASE {case} {m}', file=sys.stderr, flush=True)
    tf.nest.map_structure(lambda t: t.numpy(), step())
    print('END', file=sys.stderr, flush=True)


for case in sys.argv[2:]:
    for m in (2, 6):
        run(case, m)
"""

CASES = [
    'gpipe:except_last',
    '1f1b:except_last',
    '1f1b:never',
    'interleaved_1f1b:except_last',
    'zero_bubble:never',
    'zero_bubble:always',
    'eval:always',
    'fprop:except_last',
]


def _new_copies(mode, cases):
    """{(case, M): the function copies Grappler specialised at that step's first run}."""
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL='0',
        TF_CPP_VMODULE='function_optimizer=2',
        PYTHONPATH=ROOT,
    )
    done = subprocess.run(
        [sys.executable, '-c', SCRIPT, mode, *cases],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts, case = {}, None
    for line in done.stderr.splitlines():
        marker = re.match(r'CASE (\S+) (\d+)$', line)
        if marker:
            case = (marker.group(1), int(marker.group(2)))
            counts[case] = 0
        elif line == 'END':
            case = None
        elif case and 'Specialize function call:' in line:
            counts[case] += 1
        elif case and 'already specialized in identical context' in line:
            counts[case] -= 1  # a call that shares an earlier copy
    assert len(counts) == 2 * len(cases), done.stderr[-3000:]
    return counts


def test_no_function_is_specialised_per_micro_batch():
    counts = _new_copies('opaque', CASES)
    for case in CASES:
        assert counts[case, 6] == counts[case, 2], (case, counts)


def test_the_count_sees_constant_arguments():
    # Without opaque, each micro-batch's constant weights (and d loss = 1) make a copy.
    counts = _new_copies('identity', ['1f1b:except_last'])
    assert counts['1f1b:except_last', 6] > counts['1f1b:except_last', 2], counts


def test_opaque_is_an_identity_with_its_gradient():
    @tf.function(autograph=False)
    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = opaque.opaque({'a': x * 3.0, 'b': None, 'c': tf.constant([1, 2])})
        ops = {op.type for op in tf.compat.v1.get_default_graph().get_operations()}
        return y['a'], y['c'], tape.gradient(y['a'], x), 'PlaceholderWithDefault' in ops

    y, c, dx, hidden = f(tf.constant([-0.0, 2.0]))
    assert bool(hidden)
    assert y.numpy().tolist() == [-0.0, 6.0] and str(y.numpy()[0]) == '-0.0'  # bits kept
    assert c.numpy().tolist() == [1, 2]
    assert dx.numpy().tolist() == [3.0, 3.0]
    eager = tf.constant(1.0)
    assert opaque.opaque(eager) is eager
