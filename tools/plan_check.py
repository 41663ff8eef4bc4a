"""The planner against this machine: predicted vs measured peak memory per device and step time.

    python tools/plan_check.py --output=docs/results/plan_check.json      # about 12 minutes
    python tools/plan_check.py --configs=fc:8:1024:2:4:gpipe:always --steps=3
    python tools/plan_check.py --repredict=docs/results/plan_check.json   # planner changed

A configuration is family:knob:batch:K:M:schedule:recompute (families of bench_common). Each runs
in a fresh process with fresh TF workers, one per stage, pinned to one core each and on the BFC
allocator; an Adam training step (ComputeGradients, as the trainer runs it) is timed (median of --steps),
then every worker reports its allocator's peak. The prediction is `planning.plan` with this
machine's measured times: each layer's forward and backward at the micro-batch's size, measured
on a spare pinned worker before the step runs, and the loopback link between two
workers (`planning.measure`). --local: K=1 in this process (memory only; the test's mode).
"""

import json
import os
import subprocess
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')

from absl import app, flags  # noqa: E402

DEFAULT_CONFIGS = [
    'fc:8:1024:1:1:gpipe:never',
    'fc:8:1024:1:4:gpipe:always',
    'fc:8:1024:2:4:gpipe:always',
    'fc:8:1024:2:4:gpipe:never',
    'fc:8:1024:2:8:1f1b:never',
    'fc:8:1024:2:8:zero_bubble:never',
    'transformer:4:32:1:1:gpipe:never',
    'transformer:4:32:2:4:gpipe:always',
    'transformer:4:32:2:4:1f1b:except_last',
    'amoebanet:1:32:1:2:gpipe:always',
    'amoebanet:1:32:2:4:gpipe:always',
]
CONFIGS = flags.DEFINE_list('configs', DEFAULT_CONFIGS, 'family:knob:batch:K:M:schedule:recompute')
STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps per configuration (median).')
LOCAL = flags.DEFINE_bool('local', False, 'K=1 in this process, memory only (no workers).')
OUTPUT = flags.DEFINE_string('output', '', 'Also write the JSON result to this file.')
JSON = flags.DEFINE_bool('json', False, 'Print JSON instead of a table.')
CELL_GRAPPLER = flags.DEFINE_bool(
    'cell_grappler', None, "PipelinedLayer.cell_grappler (default: the library's)."
)
REPREDICT = flags.DEFINE_string(
    'repredict', None, 'Recompute the predictions of this result file from its measurements.'
)
CHILD = flags.DEFINE_string('child', None, 'Internal: "link" or one configuration.')
LINK = flags.DEFINE_list('link', None, 'Internal: measured bytes/s and latency.')

SLOTS = 2  # Adam


def _parse(config):
    family, knob, batch, k, m, schedule, recompute = config.split(':')
    return family, int(knob), int(batch), int(k), int(m), schedule, recompute


def _env():
    return dict(TF_CPU_ALLOCATOR_USE_BFC='true', TF_GPIPE_MEMORY_REPORT='1')


def _measure_link():
    from tf_gpipe.planning import measure
    from tf_gpipe.runtime import local_cluster

    with local_cluster.LocalCluster(2, cores=[0, 1]) as cluster:
        cluster.connect()
        bandwidth, latency = measure.link(cluster.device(0), cluster.device(1))
    return dict(link_bytes_per_second=bandwidth, link_latency_seconds=latency)


def _predict(config, layer_seconds, link):
    from bench_common import family_layers

    from tf_gpipe import planning

    family, knob, batch, k, m, schedule, recompute = _parse(config)
    sub, shape = family_layers(family, knob)
    device = planning.Device(planning.THIS_MACHINE, 1 << 40, 1.0, *link)
    return planning.plan(
        sub, (batch,) + shape, k, m, device, schedule, recompute, SLOTS,
        layer_seconds=layer_seconds,
    )  # fmt: skip


def _step(model, shape, batch, device):
    """An Adam step as the trainer runs it: ComputeGradients (the loss per micro-batch on the
    last stage), then the update on each variable's device."""
    import tensorflow as tf
    from bench_common import batch_input

    from tf_gpipe.runtime import placement

    variables = model.trainable_variables
    optimizer = placement.build_optimizer(tf.keras.optimizers.Adam(1e-4), variables)
    x = batch_input(shape, batch, device)

    def loss_fn(out, _):
        out = out[0] if isinstance(out, tuple) else out
        return tf.reduce_mean(tf.square(out))

    @tf.function
    def step():
        loss, grads = model.ComputeGradients(x, None, loss_fn)
        placement.apply_gradients(optimizer, zip(grads, variables))
        return loss

    return step


def _run_local(config):
    """K=1 in this process: the highest peak of the allocator over --steps steps (as the
    workers' peaks of the other mode: a device must hold the step that needs most), weights
    and slots included (measured from an empty allocator: nothing else of this process's
    lives there)."""
    import tensorflow as tf
    from bench_common import build, family_layers

    family, knob, batch, k, m, schedule, recompute = _parse(config)
    if k != 1:
        raise app.UsageError(f'--local runs K=1 only ({config}).')
    sub, shape = family_layers(family, knob)
    tf.config.experimental.reset_memory_stats('CPU:0')
    base = tf.config.experimental.get_memory_info('CPU:0')['current']
    model = build(
        sub, shape, ['/device:CPU:0'], m, recompute, schedule=schedule,
        cell_grappler=CELL_GRAPPLER.value,
    )  # fmt: skip
    step = _step(model, shape, batch, '/device:CPU:0')
    step().numpy()  # trace and warm up
    peaks = []
    for _ in range(STEPS.value):
        tf.config.experimental.reset_memory_stats('CPU:0')
        step().numpy()
        peaks.append(tf.config.experimental.get_memory_info('CPU:0')['peak'] - base)
    return dict(measured_peak_bytes=[max(peaks)], measured_step_seconds=None)


def _run_child(config, link):
    """One configuration on fresh workers: layer times first, then the step and its peaks."""
    import numpy as np
    from bench_common import build, family_layers
    from bench_common import seconds as seconds_of

    from tf_gpipe.planning import measure
    from tf_gpipe.runtime import local_cluster

    family, knob, batch, k, m, schedule, recompute = _parse(config)
    sub, shape = family_layers(family, knob)
    # Workers 0 .. K-1 run the step; worker K, started with them (a client connects to one
    # cluster only), times the layers first, so nothing of that lands in the stages' memory.
    cores = [i % 2 for i in range(k)] + [k % 2]
    cluster = local_cluster.LocalCluster(k + 1, cores=cores, env=_env()).start()
    try:
        cluster.connect()
        seconds = measure.layer_seconds(sub, (batch // m,) + shape, cluster.device(k))
        devices = cluster.devices()[:k]
        model = build(
            sub, shape, devices, m, recompute, schedule=schedule,
            cell_grappler=CELL_GRAPPLER.value,
        )  # fmt: skip
        step = _step(model, shape, batch, devices[0])
        for _ in range(2):  # trace and warm up
            seconds_of(step)
        times = [seconds_of(step) for _ in range(STEPS.value)]
        peaks = cluster.memory_peaks()[:k]
    finally:
        cluster.stop()
    predicted = _predict(config, seconds, link)
    return dict(
        measured_peak_bytes=peaks,
        measured_step_seconds=float(np.median(times)),
        step_seconds_spread=[min(times), max(times)],
        layer_seconds=[list(map(float, s)) for s in seconds],
        predicted=_prediction(predicted),
    )


def _prediction(p):
    return dict(
        peak_bytes=[s.peak for s in p.stages],
        step_seconds=p.step_seconds,
        stages=[dict(vars(s), peak=s.peak) for s in p.stages],
    )


def _in_child(args):
    from bench_common import given

    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        *args,
        f'--steps={STEPS.value}',
        *given(CELL_GRAPPLER),
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f'plan_check {" ".join(args)} failed:\n{proc.stderr[-3000:]}')
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_all():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_common import library_default, run_metadata

    grappler = library_default('cell_grappler', CELL_GRAPPLER.value)
    rows = []
    if LOCAL.value:  # each in a fresh process too: an allocator nothing else has used
        for config in CONFIGS.value:
            row = dict(config=config, **_in_child([f'--child={config}', '--local']))
            row['predicted'] = _prediction(_predict(config, None, (float('inf'), 0.0)))
            rows.append(row)
        return dict(rows=rows, local=True, cell_grappler=grappler, **run_metadata())
    link = _in_child(['--child=link'])
    link_args = f'--link={link["link_bytes_per_second"]},{link["link_latency_seconds"]}'
    for config in CONFIGS.value:
        print(f'  {config}', file=sys.stderr, flush=True)
        rows.append(dict(config=config, **_in_child([f'--child={config}', link_args])))
    return dict(rows=rows, local=False, link=link, cell_grappler=grappler, **run_metadata())


def main(_):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if CHILD.value == 'link':
        print(json.dumps(_measure_link()))
        return
    if REPREDICT.value:  # the planner changed, the measurements stand
        with open(REPREDICT.value) as f:
            result = json.load(f)
        link = tuple(result['link'].values()) if result.get('link') else (float('inf'), 0.0)
        for row in result['rows']:
            seconds = row.get('layer_seconds')
            row['predicted'] = _prediction(_predict(row['config'], seconds, link))
        from bench_common import write_json
        from results_table import plan_check_table

        write_json(REPREDICT.value, result)

        print('\n'.join(plan_check_table(result)))
        return
    if CHILD.value and LOCAL.value:
        print(json.dumps(_run_local(CHILD.value)))
        return
    if CHILD.value:
        link = tuple(float(x) for x in LINK.value)
        print(json.dumps(_run_child(CHILD.value, link)))
        return
    result = measure_all()
    if OUTPUT.value:
        from bench_common import write_json

        write_json(OUTPUT.value, result)
    if JSON.value:
        print(json.dumps(result))
        return
    from results_table import plan_check_table

    print('\n'.join(plan_check_table(result)))


if __name__ == '__main__':
    app.run(main)
