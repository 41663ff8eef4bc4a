"""Peak memory of one training step: plain sequence vs PipelinedLayer (K=1) per policy.

    TF_CPU_ALLOCATOR_USE_BFC=true python tools/peak_memory.py --layers=32 --width=256 \
        --batch_size=4096 --num_micro_batches=8 --schedules=gpipe,1f1b

A deep stack of FC layers, a forward + backward step under tf.function that returns its
gradients; peak bytes above the resident weights, from TF's BFC allocator. Rows: the plain
sequence; `FProp` under a tape per policy ('pipeline K=1'); and `ComputeGradients` per schedule
of --schedules and policy. Prints a table (or --json).
"""

import json
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')

import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from tf_gpipe import gpipe, layers, memory  # noqa: E402

LAYERS = flags.DEFINE_integer('layers', 32, 'FC layers in the stack.')
WIDTH = flags.DEFINE_integer('width', 256, 'Width of every layer.')
BATCH = flags.DEFINE_integer('batch_size', 4096, 'Examples per step.')
MICRO = flags.DEFINE_integer('num_micro_batches', 8, 'M for the pipelined runs.')
ACTIVATION = flags.DEFINE_string('activation', 'TANH', 'FCLayer activation (TANH, RELU, ...).')
SCHEDULES = flags.DEFINE_list('schedules', [], 'Also ComputeGradients rows for these schedules.')
JSON = flags.DEFINE_bool('json', False, 'Print JSON instead of a table.')


def _step_fn(model, x):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model.FProp(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        return loss, [tf.reduce_sum(g) for g in grads]

    step()  # trace and warm up
    return step


def _compute_fn(model, x):
    def loss_fn(y, _):
        return tf.reduce_sum(tf.square(y)), 1.0

    @tf.function
    def step():
        loss, grads = model.ComputeGradients(x, None, loss_fn)
        return loss, [tf.reduce_sum(g) for g in grads]

    step()
    return step


def measure():
    width = WIDTH.value
    sub = [
        layers.FCLayer.Params().Set(
            name=f'fc{i}', input_dim=width, output_dim=width, activation=ACTIVATION.value
        )
        for i in range(LAYERS.value)
    ]
    x = tf.random.stateless_normal([BATCH.value, width], [1, 2])
    rows = []
    configs = [('plain', None, None)] + [
        ('pipeline K=1', MICRO.value, policy) for policy in gpipe.RECOMPUTE_POLICIES
    ]
    configs += [
        (f'{schedule} K=1', MICRO.value, policy)
        for schedule in SCHEDULES.value
        for policy in gpipe.RECOMPUTE_POLICIES
    ]
    for name, m, policy in configs:
        schedule = name.split()[0] if name.split()[0] in gpipe.SCHEDULES else None
        if m is None:
            model = layers.SequentialLayer.Params().Set(name='m', sub=sub).Instantiate()
        else:
            model = (
                gpipe.PipelinedLayer.Params()
                .Set(
                    name='m', sub=sub, partition_by='uniform', num_micro_batches=m, recompute=policy
                )
                .Set(schedule=schedule or 'gpipe')
                .Instantiate()
            )
        step = _compute_fn(model, x) if schedule else _step_fn(model, x)
        _, peak = memory.peak_bytes(step)
        rows.append(
            dict(setting=name, num_micro_batches=m or 1, recompute=policy or '-', peak_bytes=peak)
        )
    plain = rows[0]['peak_bytes']
    activations = BATCH.value * width * 4 * LAYERS.value
    for row in rows:
        row['ratio_to_plain'] = row['peak_bytes'] / plain
    return dict(
        layers=LAYERS.value,
        width=width,
        batch_size=BATCH.value,
        activation_bytes_all_layers=activations,
        rows=rows,
    )


def main(_):
    result = measure()
    if JSON.value:
        print(json.dumps(result))
        return
    print(
        f'{result["layers"]} FC layers x {result["width"]}, batch {result["batch_size"]}; '
        f'activations of all layers {result["activation_bytes_all_layers"] / 2**20:.1f} MiB'
    )
    print(
        f'{ACTIVATION.value}; K=1 rows run `FProp` under a tape, <schedule> rows ComputeGradients'
    )
    print(f'{"setting":<14}{"M":>4}  {"recompute":<12}{"peak MiB":>10}{"vs plain":>10}')
    for r in result['rows']:
        print(
            f'{r["setting"]:<14}{r["num_micro_batches"]:>4}  {r["recompute"]:<12}'
            f'{r["peak_bytes"] / 2**20:>10.1f}{r["ratio_to_plain"]:>10.2f}'
        )


if __name__ == '__main__':
    app.run(main)
