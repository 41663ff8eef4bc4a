"""A pipeline across TF worker processes on 127.0.0.1: exact, and a dead worker fails fast,
named.

Runs in a subprocess (connecting to a cluster changes this process's TF context for good).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import json, os, sys, threading, time
import numpy as np
import tensorflow as tf
from tf_gpipe import gpipe, layers
from tf_gpipe.runtime import cluster_spec, local_cluster, placement

report = {}
with local_cluster.LocalCluster(2) as cluster:
    cluster.connect()
    fc = layers.FCLayer.Params().Set(input_dim=32, output_dim=32, activation='TANH')
    sub = [fc.Copy().Set(name=f'fc{i}') for i in range(4)]
    pipe = gpipe.PipelinedLayer.Params().Set(
        name='pipe', sub=sub, num_partitions=2, partition_by='uniform', num_micro_batches=4,
        recompute='always', devices=cluster.devices(), random_seed=3).Instantiate()
    report['variable_devices'] = sorted({v.device for v in pipe.trainable_variables})
    with tf.device('/job:client/replica:0/task:0/device:CPU:0'):
        plain = layers.SequentialLayer.Params().Set(name='plain', sub=sub,
                                                    random_seed=3).Instantiate()
    x = tf.random.stateless_normal([16, 32], [1, 2])

    def loss_and_grads(layer, inputs=x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(layer.FProp(inputs)))
        return loss, tape.gradient(loss, layer.trainable_variables)

    got = tf.function(lambda: loss_and_grads(pipe))()
    want = loss_and_grads(plain)
    by_name = {v.name: g for v, g in zip(plain.trainable_variables, want[1])}
    report['loss'] = [float(got[0]), float(want[0])]
    report['max_rel_grad_err'] = max(
        float(np.abs(g - by_name[v.name]).max() / np.abs(by_name[v.name]).max())
        for v, g in zip(pipe.trainable_variables, got[1]))

    # Training keeps the optimizer's slots and updates on the workers.
    optimizer = placement.build_optimizer(tf.keras.optimizers.Adam(1e-3),
                                          pipe.trainable_variables)

    @tf.function
    def train():
        loss, grads = loss_and_grads(pipe)
        placement.apply_gradients(optimizer, zip(grads, pipe.trainable_variables))
        return loss

    losses = [float(train()) for _ in range(3)]
    report['losses_fall'] = losses[2] < losses[0]
    report['slot_devices'] = sorted({
        v.value.device for v in optimizer.variables if len(v.shape) > 0})

    # The loops across processes: eval's runs unrolled by default (each tick would cross
    # processes), as a loop when asked; a tick loop asked for runs, and the log says its cost.
    import logging
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger('absl').addHandler(handler)
    logging.getLogger('absl').setLevel(logging.INFO)
    from tf_gpipe import fprop_context
    want_eval = plain.FProp(x)
    for eval_loop in (None, True):
        looped = pipe.params.Copy().Set(eval_loop=eval_loop).Instantiate()  # the same weights

        def evaluate(pipe=looped):
            with fprop_context.eval_mode():
                return pipe.FProp(x)

        fn = tf.function(evaluate)
        graph = fn.get_concrete_function().graph.as_graph_def()
        report[f'eval_loop={eval_loop}'] = dict(
            err=float(np.abs(fn().numpy() - want_eval.numpy()).max()),
            loops=sum(f.signature.name.startswith('while_body') for f in graph.library.function),
        )
    looped = pipe.params.Copy().Set(tick_loop=True).Instantiate()
    got = tf.function(lambda: loss_and_grads(looped))()
    report['tick_loop_rel_grad_err'] = max(
        float(np.abs(g - by_name[v.name]).max() / np.abs(by_name[v.name]).max())
        for v, g in zip(looped.trainable_variables, got[1]))
    report['log'] = [m for m in seen if 'TF task' in m]

    # A worker dies in the middle of a long step: the client gets an error, no hang.
    big = [layers.FCLayer.Params().Set(name=f'big{i}', input_dim=1024, output_dim=1024)
           for i in range(8)]
    slow = gpipe.PipelinedLayer.Params().Set(
        name='slow', sub=big, num_partitions=2, partition_by='uniform', num_micro_batches=8,
        devices=cluster.devices()).Instantiate()
    with tf.device(cluster.devices()[0]):
        xb = tf.random.normal([4096, 1024])
    step = tf.function(lambda: loss_and_grads(slow, xb)[0])
    step()
    start = time.time(); step().numpy(); report['step_seconds'] = time.time() - start
    threading.Timer(report['step_seconds'] / 3, cluster.kill, args=(1,)).start()
    start = time.time()
    try:
        for _ in range(3):
            step().numpy()
        report['error'] = None
    except Exception as e:
        report['error'] = type(e).__name__
    report['seconds_to_error'] = time.time() - start
    report['unreachable'] = cluster_spec.gone(cluster.spec, ['worker'])
    report['worker_1'] = cluster.spec['worker'][1]
print(json.dumps(report))
"""


def test_pipeline_across_worker_processes():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    out = subprocess.run(
        [sys.executable, '-c', _SCRIPT],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report['variable_devices'] == [
        '/job:worker/replica:0/task:0/device:CPU:0',
        '/job:worker/replica:0/task:1/device:CPU:0',
    ]
    assert abs(report['loss'][0] - report['loss'][1]) <= 1e-5 * abs(report['loss'][1])
    assert report['max_rel_grad_err'] < 1e-5
    assert report['losses_fall']
    assert report['slot_devices'] == report['variable_devices']
    # Eval across processes: the unrolled wave by default, the loop when asked; both exact.
    assert report['eval_loop=None'] == dict(err=report['eval_loop=None']['err'], loops=0)
    assert report['eval_loop=True']['loops'] == 1
    assert max(report['eval_loop=None']['err'], report['eval_loop=True']['err']) < 1e-5
    assert report['tick_loop_rel_grad_err'] < 1e-5  # FProp's two loops across processes
    across = 'its cells are on more than one TF task (each tick would cross processes)'
    assert report['log'] == [
        f'pipe: eval_loop=None (auto), but this call runs unrolled (its program grows with '
        f'M): {across}.',
        f'pipe: eval_loop=True, and {across}: its steady step is slower than the unrolled '
        'one\'s there (docs/results.md, "Across processes"); eval_loop=None unless start-up '
        'is the wall.',
        f'pipe: tick_loop=True, and {across}: its steady step is slower than the unrolled '
        'one\'s there (docs/results.md, "Across processes"); tick_loop=False unless start-up '
        'is the wall.',
    ], report['log']
    assert report['error'] == 'UnavailableError', report
    # Documented bound: a dead worker surfaces within 30 s (measured: well under a second
    # after the step that needs it).
    assert report['seconds_to_error'] < 30, report
    assert report['unreachable'] == [['worker', 1, report['worker_1']]]  # the dead one, named


_MEMORY_SCRIPT = r"""
import json
import tensorflow as tf
from tf_gpipe.runtime import local_cluster
from tf_gpipe.planning import measure

env = dict(TF_CPU_ALLOCATOR_USE_BFC='true', TF_GPIPE_MEMORY_REPORT='1')
report = {}
cluster = local_cluster.LocalCluster(1, env=env).start()
try:
    cluster.connect()
    device = cluster.device(0)

    @tf.function
    def make():
        with tf.device(device):
            return tf.reduce_sum(tf.random.normal([4 << 20]) * 2.0)  # 16 MiB on the worker

    make()
    report['link'] = measure.link(device, '/job:client/replica:0/task:0/device:CPU:0')
    report['peaks'] = cluster.memory_peaks()
finally:
    cluster.stop()
with local_cluster.LocalCluster(1) as plain:  # no report asked for: a clear error
    try:
        plain.memory_peaks(timeout=10)
    except RuntimeError as e:
        report['error'] = str(e)
print(json.dumps(report))
"""


def test_workers_report_their_allocator_peak_and_the_link_is_measured():
    """TF_GPIPE_MEMORY_REPORT=1: a worker prints its BFC allocator's peak on SIGTERM (what
    tools/plan_check.py compares with the planner); planning.measure.link times a hop."""
    out = subprocess.run(
        [sys.executable, '-c', _MEMORY_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report['peaks']) == 1 and report['peaks'][0] >= 16 << 20, report
    bandwidth, latency = report['link']
    assert bandwidth > 1e6 and 0 <= latency < 1.0, report
    assert 'TF_GPIPE_MEMORY_REPORT=1' in report['error'], report


def test_a_started_cluster_refuses_a_second_start():
    from tf_gpipe.runtime import local_cluster

    cluster = local_cluster.LocalCluster(1)
    cluster.processes = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])]
    try:
        with pytest.raises(RuntimeError, match='already started'):
            cluster.start()
    finally:
        cluster.stop()
    assert cluster.processes == []
