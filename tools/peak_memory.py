"""Peak memory of one training step: plain sequence vs PipelinedLayer (K=1) per policy.

    TF_CPU_ALLOCATOR_USE_BFC=true python tools/peak_memory.py --layers=32 --width=256 \
        --batch_size=4096 --num_micro_batches=8 --schedules=gpipe,1f1b

A deep stack of FC layers, a forward + backward step under tf.function that returns its
gradients; peak bytes above the resident weights, from TF's BFC allocator. Rows: the plain
sequence; `FProp` under a tape per policy ('pipeline K=1'); and `ComputeGradients` per schedule
of --schedules and policy. With kept activations ('never') the peak should follow each
schedule's high-water mark from `schedules.simulate`: the table shows the measured peak next to
a prediction from that mark. Prints a table (or --json; --output also writes the JSON).
"""

import json
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')

import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from tf_gpipe import gpipe, layers  # noqa: E402
from tf_gpipe.gpipe import loop_choice, schedules  # noqa: E402
from tf_gpipe.runtime import memory  # noqa: E402

LAYERS = flags.DEFINE_integer('layers', 32, 'FC layers in the stack.')
WIDTH = flags.DEFINE_integer('width', 256, 'Width of every layer.')
BATCH = flags.DEFINE_integer('batch_size', 4096, 'Examples per step.')
MICRO = flags.DEFINE_integer('num_micro_batches', 8, 'M for the pipelined runs.')
ACTIVATION = flags.DEFINE_string('activation', 'TANH', 'FCLayer activation (TANH, RELU, ...).')
SCHEDULES = flags.DEFINE_list('schedules', [], 'Also ComputeGradients rows for these schedules.')
POLICIES = flags.DEFINE_list(
    'policies', ['always', 'except_last', 'never'], 'Recompute policies of the pipelined rows.'
)
VIRTUAL = flags.DEFINE_integer('virtual_stages', 2, 'v of an interleaved_1f1b row.')
OUTPUT = flags.DEFINE_string('output', '', 'Also write the JSON result to this file.')
JSON = flags.DEFINE_bool('json', False, 'Print JSON instead of a table.')
TICK_LOOP = flags.DEFINE_bool(
    'tick_loop',
    None,
    "PipelinedLayer.tick_loop (default: the library's, None: the loops in this one process): "
    '--tick_loop the loops, --notick_loop the unrolled executor.',
)
CELL_GRAPPLER = flags.DEFINE_bool(
    'cell_grappler',
    gpipe.PipelinedLayer.Params().cell_grappler,
    "PipelinedLayer.cell_grappler (Grappler on the cells' functions); default: the library's.",
)


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


def _activation_units(sched):
    """Most micro-batch-sized things device 0 holds at once under kept activations: the stored
    micro-batches (the validator's high-water mark) plus, when the backward is split, the
    gradients B leaves at the weights' uses for W (as large as the activations they pair with)."""
    last = schedules.WEIGHT if sched.split_backward else schedules.BACKWARD
    stored = pending = peak = 0
    for a in sched.actions[0]:
        if a.phase == schedules.FORWARD:
            stored += 1
        elif a.phase == schedules.BACKWARD and sched.split_backward:
            pending += 1
        if a.phase == last:
            stored -= 1
            pending -= 1 if sched.split_backward else 0
        peak = max(peak, stored + pending)
    return peak


def _predict_from_high_water(rows):
    """With kept activations, peak = base + units x (one micro-batch's activations): fit base
    and slope on the schedules with the fewest and most units, predict the others."""
    if len({r['activation_units'] for r in rows}) < 2:
        return
    lo = min(rows, key=lambda r: r['activation_units'])
    hi = max(rows, key=lambda r: r['activation_units'])
    slope = (hi['peak_bytes'] - lo['peak_bytes']) / (
        hi['activation_units'] - lo['activation_units']
    )
    for r in rows:
        units = r['activation_units'] - lo['activation_units']
        r['predicted_bytes'] = lo['peak_bytes'] + units * slope
        r['measured_vs_predicted'] = r['peak_bytes'] / r['predicted_bytes']


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
        ('pipeline K=1', MICRO.value, policy) for policy in POLICIES.value
    ]
    configs += [
        (f'{schedule} K=1', MICRO.value, policy)
        for schedule in SCHEDULES.value
        for policy in POLICIES.value
    ]
    for name, m, policy in configs:
        schedule = name.split()[0] if name.split()[0] in gpipe.SCHEDULES else None
        high_water = None
        if m is None:
            model = layers.SequentialLayer.Params().Set(name='m', sub=sub).Instantiate()
        else:
            v = VIRTUAL.value if schedule == 'interleaved_1f1b' else 1
            model = (
                gpipe.PipelinedLayer.Params()
                .Set(
                    name='m', sub=sub, partition_by='uniform', num_micro_batches=m, recompute=policy
                )
                .Set(schedule=schedule or 'gpipe', virtual_stages=v, tick_loop=TICK_LOOP.value)
                .Set(cell_grappler=CELL_GRAPPLER.value)
                .Instantiate()
            )
            # The validator's high-water mark of device 0, in micro-batches of the whole stack
            # (an interleaved chunk is 1/v of it).
            sched = schedules.build(schedule or 'gpipe', 1, m, v)
            high_water = schedules.simulate(sched).high_water[0] / v
            units = _activation_units(sched) / v
        step = _compute_fn(model, x) if schedule else _step_fn(model, x)
        _, peak = memory.peak_bytes(step)
        rows.append(
            dict(
                setting=name,
                num_micro_batches=m or 1,
                recompute=policy or '-',
                peak_bytes=peak,
                high_water=high_water,
                activation_units=None if m is None else units,
            )
        )
    plain = rows[0]['peak_bytes']
    activations = BATCH.value * width * 4 * LAYERS.value
    for row in rows:
        row['ratio_to_plain'] = row['peak_bytes'] / plain
    scheduled = [r for r in rows if r['setting'].split()[0] in gpipe.SCHEDULES]
    _predict_from_high_water([r for r in scheduled if r['recompute'] == 'never'])
    return dict(
        layers=LAYERS.value,
        width=width,
        batch_size=BATCH.value,
        activation_bytes_all_layers=activations,
        rows=rows,
    )


def main(_):
    from bench_common import library_default, run_metadata

    # One process: the library's default (None) runs the loops from AUTO_MIN_MICRO_BATCHES on.
    asked = library_default('tick_loop', TICK_LOOP.value)
    loop = asked is True or (asked is None and MICRO.value >= loop_choice.AUTO_MIN_MICRO_BATCHES)
    result = dict(measure(), tick_loop=loop, cell_grappler=CELL_GRAPPLER.value, **run_metadata())
    if OUTPUT.value:
        from bench_common import write_json

        write_json(OUTPUT.value, result)
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
    print(
        f'{"setting":<22}{"M":>4}  {"recompute":<12}{"peak MiB":>10}{"vs plain":>10}'
        f'{"high-water":>12}{"units":>7}{"predicted MiB":>15}'
    )
    for r in result['rows']:
        hw = '' if r['high_water'] is None else f'{r["high_water"]:g}'
        units = '' if r['activation_units'] is None else f'{r["activation_units"]:g}'
        pred = f'{r["predicted_bytes"] / 2**20:.1f}' if 'predicted_bytes' in r else ''
        print(
            f'{r["setting"]:<22}{r["num_micro_batches"]:>4}  {r["recompute"]:<12}'
            f'{r["peak_bytes"] / 2**20:>10.1f}{r["ratio_to_plain"]:>10.2f}{hw:>12}{units:>7}'
            f'{pred:>15}'
        )
    print(
        "high-water: the validator's stored micro-batches (device 0); units: those plus, when "
        'the backward is split, the\nmicro-batches between B and W (their gradients at the '
        "weights' uses); predicted: for recompute='never', base +\nunits x slope fitted on the "
        'rows with the fewest and most units'
    )


if __name__ == '__main__':
    app.run(main)
