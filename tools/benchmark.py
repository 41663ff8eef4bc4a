"""Pipeline speed-up across TF worker processes: K stages on K single-core workers vs K=1.

    python tools/benchmark.py --num_stages=2 --num_micro_batches=8 --recompute=always

Each stage runs in its own TF worker process on 127.0.0.1, pinned to one core (taskset, one
intra-op thread); this process is the client. A training step (forward, backward, SGD update,
all on the workers) of a deep FC stack is timed for K=1 (every layer on worker 0) and for K
stages, with the same M and recompute policy. Printed: step times, speed-up, the bubble bound
K*M/(M+K-1) and efficiency = speed-up / bound. --json for machine-readable output.
"""

import json
import os
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from tf_gpipe import gpipe, layers, local_cluster  # noqa: E402

STAGES = flags.DEFINE_integer('num_stages', 2, 'K: stages (one single-core worker each).')
MICRO = flags.DEFINE_integer('num_micro_batches', 8, 'M.')
POLICY = flags.DEFINE_enum('recompute', 'always', gpipe.RECOMPUTE_POLICIES, 'Recompute policy.')
LAYERS = flags.DEFINE_integer('layers', 16, 'FC layers.')
WIDTH = flags.DEFINE_integer('width', 512, 'Layer width.')
BATCH = flags.DEFINE_integer('batch_size', 2048, 'Examples per step.')
STEPS = flags.DEFINE_integer('steps', 10, 'Timed steps of each (after 2 warm-up steps).')
JSON = flags.DEFINE_bool('json', False, 'Print JSON.')


def _sub():
    return [
        layers.FCLayer.Params().Set(
            name=f'fc{i}', input_dim=WIDTH.value, output_dim=WIDTH.value, activation='RELU'
        )
        for i in range(LAYERS.value)
    ]


def _step_fn(devices, num_stages):
    """A compiled training step of the FC stack cut into `num_stages` stages on `devices`."""
    pipe = (
        gpipe.PipelinedLayer.Params()
        .Set(
            name=f'pipe{num_stages}',
            sub=_sub(),
            num_partitions=num_stages,
            partition_by='uniform',
            num_micro_batches=MICRO.value,
            recompute=POLICY.value,
            devices=devices[:num_stages],
            random_seed=1,
        )
        .Instantiate()
    )
    with tf.device(devices[0]):
        x = tf.random.stateless_normal([BATCH.value, WIDTH.value], [1, 2])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(pipe.FProp(x)))
        grads = tape.gradient(loss, pipe.trainable_variables)
        for v, g in zip(pipe.trainable_variables, grads):
            v.assign_sub(1e-4 * g)  # runs where v lives: on its worker
        return loss

    for _ in range(2):  # trace, warm up
        step().numpy()
    return step


def _seconds(step):
    start = time.perf_counter()
    step().numpy()
    return time.perf_counter() - start


def measure():
    k, m = STAGES.value, MICRO.value
    with local_cluster.LocalCluster(k, cores=list(range(k))) as cluster:
        cluster.connect()
        devices = cluster.devices()
        one, many = _step_fn(devices, 1), _step_fn(devices, k)
        # Alternate the two so that drift in the machine's load hits both alike.
        t1, tk = [], []
        for _ in range(STEPS.value):
            t1.append(_seconds(one))
            tk.append(_seconds(many))
    t1, tk = float(np.median(t1)), float(np.median(tk))
    speedup = t1 / tk
    bound = k * m / (m + k - 1)
    return dict(
        num_stages=k,
        num_micro_batches=m,
        recompute=POLICY.value,
        layers=LAYERS.value,
        width=WIDTH.value,
        batch_size=BATCH.value,
        step_seconds_k1=t1,
        step_seconds_k=tk,
        speedup=speedup,
        bubble_bound=bound,
        efficiency=speedup / bound,
    )


def main(_):
    r = measure()
    if JSON.value:
        print(json.dumps(r))
        return
    print(
        f'{r["layers"]} FC layers x {r["width"]}, batch {r["batch_size"]}, '
        f'M={r["num_micro_batches"]}, recompute={r["recompute"]}, one single-core TF worker '
        'per stage'
    )
    print(f'{"K":>3}{"step s":>10}{"speed-up":>10}{"bound":>8}{"efficiency":>12}')
    print(f'{1:>3}{r["step_seconds_k1"]:>10.3f}{1.0:>10.2f}{1.0:>8.2f}{1.0:>12.2f}')
    print(
        f'{r["num_stages"]:>3}{r["step_seconds_k"]:>10.3f}{r["speedup"]:>10.2f}'
        f'{r["bubble_bound"]:>8.2f}{r["efficiency"]:>12.2f}'
    )


if __name__ == '__main__':
    app.run(main)
