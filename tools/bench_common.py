"""What the benchmark tools share: the model families and a timed Adam/SGD training step."""

import datetime
import os
import platform
import shlex
import sys
import time

import numpy as np
import tensorflow as tf

from tf_gpipe import gpipe, layers
from tf_gpipe.gpipe import schedules
from tf_gpipe.layers.amoebanet import AmoebaNetLayers
from tf_gpipe.runtime import placement

# Model families: the knob grows the model (Transformer layers; AmoebaNet normal cells per stack).
FAMILIES = {
    'transformer': dict(model_dim=128, num_heads=4, hidden_dim=512, seq_len=128),
    'amoebanet': dict(filters=16, image_size=32, num_classes=10, stem_filters=16),
    'fc': dict(width=512),
}


def family_layers(family, knob, **overrides):
    """(layer params, input shape without the batch) of `family` grown to `knob`."""
    c = dict(FAMILIES[family], **overrides)
    if family == 'transformer':
        sub = [
            layers.TransformerLayer.Params().Set(
                name=f'layer{i}',
                input_dim=c['model_dim'],
                num_heads=c['num_heads'],
                hidden_dim=c['hidden_dim'],
                causal=True,
            )
            for i in range(knob)
        ]
        return sub, (c['seq_len'], c['model_dim'])
    if family == 'amoebanet':
        sub = AmoebaNetLayers(
            3 * knob, c['filters'], c['num_classes'], stem='cifar', stem_filters=c['stem_filters']
        )
        return sub, (c['image_size'], c['image_size'], 3)
    sub = [
        layers.FCLayer.Params().Set(
            name=f'fc{i}', input_dim=c['width'], output_dim=c['width'], activation='RELU'
        )
        for i in range(knob)
    ]
    return sub, (c['width'],)


def batch_input(input_shape, batch, device):
    """A fixed random batch of `input_shape` examples, on `device` (the first stage's)."""
    with tf.device(device):
        return tf.random.stateless_normal((batch,) + tuple(input_shape), [1, 2])


def library_default(name, value):
    """A tool's flag for PipelinedLayer param `name`: its value, or (None, not given) the
    library's default, so that a tool measures what a user gets when the default changes."""
    return gpipe.PipelinedLayer.Params().Get(name) if value is None else value


def given(*flags_):
    """`--name=value` of each flag given a value (None: the library's default, left out)."""
    return [f'--{f.name}={f.value}' for f in flags_ if f.value is not None]


def build(
    sub,
    input_shape,
    devices,
    num_micro_batches=1,
    recompute='never',
    plain=False,
    partition_by='flops',
    schedule='gpipe',
    virtual_stages=1,
    cell_grappler=None,
):
    """The plain layer sequence on devices[0] (plain=True) or a PipelinedLayer on devices."""
    if plain:
        with tf.device(devices[0]):
            return layers.SequentialLayer.Params().Set(name='plain', sub=sub).Instantiate()
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name=f'pipe{len(devices)}',
            sub=sub,
            num_partitions=len(devices),
            partition_by=partition_by,
            schedule=schedule,
            virtual_stages=virtual_stages,
            input_shape=(1,) + tuple(input_shape),
            num_micro_batches=num_micro_batches,
            recompute=recompute,
            devices=list(devices),
            random_seed=1,
        )
        .Set(**({} if cell_grappler is None else dict(cell_grappler=cell_grappler)))
        .Instantiate()
    )


def train_step(model, x, optimizer=None, trace_events=None):
    """A tf.function training step: loss, gradients, update (on the variables' devices).

    With `trace_events` (a list from gpipe.trace.record()), the step also returns the
    [start, end] timestamps of every recorded pipeline action.
    """
    variables = model.trainable_variables
    # Every op is placed on a worker: on a TF cluster an unplaced op runs on the client, which
    # would make the client (an unpinned process) do part of the work. The plain sequence runs
    # wholly on its one device; a pipeline places its own ops, the loss goes to its last stage.
    pipelined = hasattr(model, 'devices')
    step_device = None if pipelined else variables[0].device
    loss_device = model.devices[-1] if pipelined else step_device

    def loss_fn(out, targets):
        del targets
        out = out[0] if isinstance(out, tuple) else out
        return tf.reduce_mean(tf.square(tf.cast(out, tf.float32)))

    def run():
        if pipelined and model.params.schedule != 'gpipe':
            loss, grads = model.ComputeGradients(x, None, loss_fn)
            return apply(loss, grads)
        with tf.device(step_device), tf.GradientTape() as tape:
            out = model.FProp(x)
            out = out[0] if isinstance(out, tuple) else out
            with tf.device(loss_device):
                loss = tf.reduce_mean(tf.square(tf.cast(out, tf.float32)))
        with tf.device(loss_device):  # where the backward pass starts
            grads = tape.gradient(loss, variables)
        return apply(loss, grads)

    def apply(loss, grads):
        if optimizer is None:
            for v, g in zip(variables, grads):
                with tf.device(v.device):
                    v.assign_sub(1e-6 * g)  # plain SGD, run where v lives
        else:
            placement.apply_gradients(optimizer, zip(grads, variables))
        return loss

    if trace_events is None:
        return tf.function(run)

    @tf.function
    def traced():
        loss = run()
        return loss, [tf.stack([e.start, e.end]) for e in trace_events]

    return traced


def seconds(step):
    start = time.perf_counter()
    tf.nest.map_structure(lambda t: t.numpy(), step())
    return time.perf_counter() - start


def median_times(steps, repeats, warmup=2):
    """Median seconds of each step function, timed alternately so machine drift hits all alike."""
    for step in steps:
        for _ in range(warmup):
            seconds(step)
    times = [[] for _ in steps]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            times[i].append(seconds(step))
    return [float(np.median(t)) for t in times]


# Environment variables that change what TF computes or how fast (kernels, allocator, threads,
# XLA): a result's command names those that were set, so that it reruns as measured.
RESULT_ENV = (
    'TF_ENABLE_ONEDNN_OPTS',
    'TF_CPU_ALLOCATOR_USE_BFC',
    'TF_CPU_BFC_MEM_LIMIT_IN_MB',
    'TF_NUM_INTEROP_THREADS',
    'TF_NUM_INTRAOP_THREADS',
    'TF_XLA_FLAGS',
)


def run_metadata():
    """Where and how a result was measured: machine, TF version, date, command line (quoted
    as a shell reads it, so that a flag with spaces reruns as written; the variables of
    RESULT_ENV that were set come first, as a shell sets them)."""
    env = [f'{k}={os.environ[k]}' for k in RESULT_ENV if k in os.environ]
    return dict(
        machine=f'{platform.machine()} {platform.system()}, {os.cpu_count()} cores',
        tf_version=tf.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
        command=shlex.join([*env, 'python', os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
    )


def write_json(path, result):
    """Writes a tool's result file (creating its folder): what results_table.py reads."""
    import json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(result, f, indent=1)


def largest(trial, max_knob, start=1, log=print):
    """(largest knob k with trial(k) ok, its result): doubling from `start`, then bisection."""
    best, best_result = 0, None
    knob, fail = max(start, 1), None
    while knob <= max_knob:
        result = trial(knob)
        log(f'  knob {knob}: {"ok" if result["ok"] else "fails"}')
        if not result['ok']:
            fail = knob
            break
        best, best_result = knob, result
        if knob >= max_knob:
            break
        knob = min(2 * knob, max_knob)
    if fail is None:
        return best, best_result
    lo, hi = best, fail  # lo ok (or 0), hi fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        result = trial(mid)
        log(f'  knob {mid}: {"ok" if result["ok"] else "fails"}')
        if result['ok']:
            lo, best_result = mid, result
        else:
            hi = mid
    return lo, best_result


def bubble(events, num_stages, span):
    """Measured idle share of each device over the step span, and their mean."""
    idle = []
    for k in range(num_stages):
        # Stage s runs on device s mod K (interleaved schedules have K*v stages).
        busy = sum(end - start for _, stage, _, start, end in events if stage % num_stages == k)
        idle.append(1.0 - busy / span)
    return idle, float(np.mean(idle))


def ideal_events(sched, t_forward, t_backward, t_weight=0.0):
    """The schedule simulated with the given durations: [(phase, stage, m, start, end)]."""
    sim = schedules.simulate(sched, t_forward, t_backward, t_weight or None)
    return [(a.phase, a.stage, a.micro_batch, start, end) for a, (start, end) in sim.times.items()]
