"""The GPipe paper's Table 1 at small scale: the largest model that trains in a memory budget.

    python tools/max_model_size.py --family=transformer --budget_mb=256
    python tools/max_model_size.py --family=amoebanet --budget_mb=256

A device with `budget_mb` of memory is TF's CPU BFC allocator capped at that size
(TF_CPU_ALLOCATOR_USE_BFC=true, TF_CPU_BFC_MEM_LIMIT_IN_MB). A model family grows along one knob
(Transformer layers; AmoebaNet normal cells per stack, L/3). For each setting the tool finds the
largest knob whose Adam training step (weights, gradients, both Adam slots and activations)
runs in the budget, every trial in a fresh process:

- naive: the plain layer sequence, no pipeline, no recompute;
- pipeline-1: PipelinedLayer K=1, M micro-batches, recompute='always';
- pipeline-2: K=2 on two TF worker processes on 127.0.0.1, each capped at the budget.

It prints, per setting, the knob, parameters, parameter memory (weights + Adam slots) and the
peak memory of a step above it (activations, gradients; measured on the local device, so not
for pipeline-2's remote workers). --json for machine-readable output.
"""

import json
import os
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from absl import app, flags  # noqa: E402

FAMILY = flags.DEFINE_enum('family', 'transformer', ['transformer', 'amoebanet'], 'Model family.')
BUDGET = flags.DEFINE_integer('budget_mb', 256, 'Memory per device, MB.')
SETTINGS = flags.DEFINE_list('settings', ['naive', 'pipeline-1', 'pipeline-2'], 'Settings.')
MICRO = flags.DEFINE_integer('num_micro_batches', 8, 'M of the pipelined settings.')
BATCH = flags.DEFINE_integer('batch_size', 32, 'Examples per step.')
MAX_KNOB = flags.DEFINE_integer('max_knob', 256, 'Stop growing at this knob.')
START_KNOB = flags.DEFINE_integer('start_knob', 1, 'Where the search of the first setting starts.')
TIMEOUT = flags.DEFINE_integer(
    'trial_timeout', 900, 'Seconds per trial before it counts as failed.'
)
JSON = flags.DEFINE_bool('json', False, 'Print JSON.')
OUTPUT = flags.DEFINE_string('output', '', 'Also write the JSON result to this file.')
# Internal: run one trial in this process (the parent sets the memory budget in its env).
TRIAL = flags.DEFINE_string('trial', None, 'Internal: "<setting>:<knob>".')


def _trial(setting, knob):
    """Runs two training steps of the model at `knob`; returns a result dict."""
    import tensorflow as tf
    from bench_common import batch_input, build, family_layers, train_step

    from tf_gpipe.runtime import local_cluster, memory, placement

    sub, shape = family_layers(FAMILY.value, knob)
    cluster, devices = None, ['/device:CPU:0']
    if setting == 'pipeline-2':
        budget = dict(
            TF_CPU_ALLOCATOR_USE_BFC='true',
            TF_CPU_BFC_MEM_LIMIT_IN_MB=os.environ['TF_CPU_BFC_MEM_LIMIT_IN_MB'],
        )
        cluster = local_cluster.LocalCluster(2, cores=[0, 1], env=budget).start().connect()
        devices = cluster.devices()
    model = build(
        sub,
        shape,
        devices,
        MICRO.value,
        'always',
        plain=setting == 'naive',
        partition_by='params',
    )
    try:
        variables = model.trainable_variables
        optimizer = placement.build_optimizer(tf.keras.optimizers.Adam(1e-4), variables)
        x = batch_input(shape, BATCH.value, devices[0])
        step = train_step(model, x, optimizer)
        params = sum(int(tf.size(v)) for v in variables)
        start = time.time()
        step().numpy()  # trace; the optimizer's slots exist from here on
        if setting == 'pipeline-2':
            peak = None
        else:
            _, peak = memory.peak_bytes(lambda: step().numpy())
        return dict(
            ok=True,
            params=params,
            param_bytes=params * 4 * 3,  # weights and Adam's two slots, float32
            peak_step_bytes=peak,
            seconds=time.time() - start,
        )
    finally:
        if cluster is not None:
            cluster.stop()


def run_trial(setting, knob):
    """One trial in a fresh process capped at the budget: the result dict, ok False on OOM."""
    env = dict(
        os.environ,
        TF_CPU_ALLOCATOR_USE_BFC='true',
        TF_CPU_BFC_MEM_LIMIT_IN_MB=str(BUDGET.value),
        TF_CPP_MIN_LOG_LEVEL='3',
    )
    cmd = [sys.executable, os.path.abspath(__file__), f'--trial={setting}:{knob}']
    cmd += [
        f'--family={FAMILY.value}',
        f'--num_micro_batches={MICRO.value}',
        f'--batch_size={BATCH.value}',
    ]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT.value)
    except subprocess.TimeoutExpired:
        return dict(ok=False, error='timeout')
    for line in proc.stdout.splitlines():
        if line.startswith('{'):
            return json.loads(line)
    # Not an out-of-memory answer: a bug or a crash, which must not pass for "too big".
    raise RuntimeError(f'Trial {setting}:{knob} failed:\n{proc.stderr[-3000:]}')


def _mib(n):
    return '-' if n is None else f'{n / 2**20:.1f}'


def main(_):
    if TRIAL.value:
        setting, knob = TRIAL.value.split(':')
        import tensorflow as tf

        try:
            print(json.dumps(_trial(setting, int(knob))))
        except tf.errors.ResourceExhaustedError as e:  # does not fit: the answer we look for
            print(json.dumps(dict(ok=False, error=f'OOM: {str(e)[:160]}')))
        except tf.errors.CancelledError as e:
            if setting != 'pipeline-2':
                raise
            # A worker that runs out of memory aborts the step; the client may hear of it as
            # the other worker's receive being cancelled rather than as the OOM itself.
            print(json.dumps(dict(ok=False, error=f'cancelled on a worker: {str(e)[:160]}')))
        return
    import bench_common
    from bench_common import FAMILIES

    knob_name = 'layers' if FAMILY.value == 'transformer' else 'cells/stack'
    config = FAMILIES[FAMILY.value]
    rows, start = [], START_KNOB.value
    for setting in SETTINGS.value:
        log = (lambda s: print(s, file=sys.stderr)) if JSON.value else print
        log(f'{setting}:')
        # Each setting holds at least what the previous one did: start the search there.
        knob, result = bench_common.largest(
            lambda k, s=setting: run_trial(s, k), MAX_KNOB.value, start, log
        )
        rows.append(dict(setting=setting, knob=knob, **(result or {})))
        start = max(start, knob)
    out = dict(
        family=FAMILY.value,
        config=config,
        budget_mb=BUDGET.value,
        batch_size=BATCH.value,
        num_micro_batches=MICRO.value,
        knob=knob_name,
        rows=rows,
        **bench_common.run_metadata(),
    )
    if OUTPUT.value:
        bench_common.write_json(OUTPUT.value, out)
    if JSON.value:
        print(json.dumps(out))
        return
    print(
        f'\n{FAMILY.value} {config}, batch {BATCH.value}, M={MICRO.value}, Adam, '
        f'budget {BUDGET.value} MB per device'
    )
    base = rows[0].get('params') or 0
    print(
        f'{"setting":<12}{knob_name:>12}{"params":>12}{"x naive":>9}'
        f'{"param MiB":>11}{"peak step MiB":>15}'
    )
    for r in rows:
        ratio = f'{r["params"] / base:.2f}' if base and r.get('params') else '-'
        print(
            f'{r["setting"]:<12}{r["knob"]:>12}{r.get("params", 0):>12,}{ratio:>9}'
            f'{_mib(r.get("param_bytes")):>11}{_mib(r.get("peak_step_bytes")):>15}'
        )


if __name__ == '__main__':
    app.run(main)
