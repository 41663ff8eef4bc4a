"""Data parallelism timed the tf.distribute way, for benchmark.py --data_parallel.

R=1: one process pinned to one core runs the training step (K=1, global batch B). R=2: two
processes, each pinned to its own core, run the same step as the two replicas of a
MultiWorkerMirroredStrategy (`mesh.strategy()` of a two-task mesh; B/2 examples each, gradients
summed by the strategy's collective all-reduce). A process reports the median of its timed steps;
R=2 reports the chief's (the all-reduce keeps the two in step).

Run as a script, this file is one such process: `python bench_replicas.py '<job JSON>'`.
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys

TOOLS = os.path.dirname(os.path.abspath(__file__))


def _launch(job, num_replicas, timeout):
    """Median step seconds of `job` run by `num_replicas` single-core processes (the chief's)."""
    from tf_gpipe.runtime import local_cluster

    addresses = [f'127.0.0.1:{p}' for p in local_cluster.free_ports(num_replicas)]
    procs = []
    for i in range(num_replicas):
        env = dict(
            os.environ,
            TF_CPP_MIN_LOG_LEVEL='3',
            TF_NUM_INTRAOP_THREADS='1',
            TF_NUM_INTEROP_THREADS='2',  # as LocalCluster's pinned workers
        )
        if num_replicas > 1:
            task = {'type': 'worker', 'index': i}
            env['TF_CONFIG'] = json.dumps({'cluster': {'worker': addresses}, 'task': task})
        else:
            env.pop('TF_CONFIG', None)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            json.dumps(dict(job, replicas=num_replicas)),
        ]
        if shutil.which('taskset'):
            cmd = ['taskset', '-c', str(i % (os.cpu_count() or 1))] + cmd
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f'a data-parallel benchmark process ran over {timeout} s') from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i, (proc, (_, err)) in enumerate(zip(procs, outs)):
        if proc.returncode:
            raise RuntimeError(
                f'data-parallel process {i} of {num_replicas} failed:\n{err[-3000:]}'
            )
    return json.loads(outs[0][0].strip().splitlines()[-1])['seconds']


def measure(family, config, micro_batches, policy, steps, runs, timeout=600):
    """Rows {run, num_micro_batches, seconds_r1, seconds_r2} (B = config's batch, K=1)."""
    rows = []
    for run in range(runs):
        for m in micro_batches:
            job = dict(
                family=family,
                knob=config['knob'],
                batch=config['batch'],
                overrides=config['overrides'],
                num_micro_batches=m,
                recompute=policy,
                steps=steps,
            )
            # R=1 and R=2 one after the other, each on fresh processes.
            r1 = _launch(job, 1, timeout)
            r2 = _launch(job, 2, timeout)
            rows.append(dict(run=run, num_micro_batches=m, seconds_r1=r1, seconds_r2=r2))
    return rows


def _replica(job):
    """One process's part: build the K=1 pipeline (under the strategy for R > 1), time steps."""
    import numpy as np
    import tensorflow as tf

    sys.path.insert(0, TOOLS)
    from bench_common import family_layers, seconds

    from tf_gpipe import gpipe
    from tf_gpipe.runtime import cluster, placement

    replicas = job['replicas']
    strategy = None
    if replicas > 1:
        spec = json.loads(os.environ['TF_CONFIG'])['cluster']
        mesh = cluster.DeviceMesh.from_cluster(
            spec, num_replicas=replicas, num_stages=1, devices_per_task=1
        )
        strategy = mesh.strategy()  # MultiWorkerMirroredStrategy: made before TF starts
    sub, shape = family_layers(job['family'], job['knob'], **job['overrides'])
    local = job['batch'] // replicas
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        p = gpipe.PipelinedLayer.Params().Set(
            name='pipe1',
            sub=sub,
            num_partitions=1,
            input_shape=(1,) + tuple(shape),
            num_micro_batches=job['num_micro_batches'],
            recompute=job['recompute'],
            random_seed=1,
        )
        if strategy is None:
            p.devices = ['/device:CPU:0']
        model = p.Instantiate()
        optimizer = tf.keras.optimizers.SGD(1e-6)
        optimizer.build(model.trainable_variables)

    def loss_fn(out, targets):
        del targets
        out = out[0] if isinstance(out, tuple) else out
        return tf.reduce_mean(tf.square(tf.cast(out, tf.float32)))

    def replica_step(x):
        # Under the strategy: this replica's share of the global mean's gradients; the
        # optimizer's all-reduce (the strategy's collective) sums the shares.
        loss, grads = model.ComputeGradients(x, None, loss_fn)
        placement.apply_gradients(optimizer, zip(grads, model.trainable_variables))
        return loss

    def make_input(_=None):
        return tf.random.stateless_normal((local,) + tuple(shape), [1, 2])

    if strategy is None:
        x = make_input()
        step = tf.function(lambda: replica_step(x))
    else:
        x = strategy.experimental_distribute_values_from_function(make_input)
        step = tf.function(
            lambda: strategy.experimental_local_results(strategy.run(replica_step, args=(x,)))
        )
    for _ in range(2):
        seconds(step)
    times = [seconds(step) for _ in range(job['steps'])]
    print(json.dumps(dict(seconds=float(np.median(times)), all=times)))


if __name__ == '__main__':
    _replica(json.loads(sys.argv[1]))
