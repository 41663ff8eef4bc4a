"""A picture of one GPipe training step as it ran: one row per device, a bar per action.

    python tools/timeline.py --num_stages=2 --num_micro_batches=8 --output=runs/timeline.png

K single-core TF worker processes on 127.0.0.1 (one per stage) run a pipelined training step
of a deep FC stack under any --schedule. `gpipe.trace` stamps each action on its device when
its inputs exist and when its outputs do, without changing the step (same calls, kept forwards
still inline), so each forward (F), backward (B) and weight-gradient (W) action of each
micro-batch is drawn where it really ran; the ideal schedule, with the same mean F, B and W
durations, is drawn underneath. Printed: the measured bubble (idle share of each device
between the step's first and last action) next to the ideal one. Needs matplotlib
(pip install -e .[plot]).
"""

import json
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

STAGES = flags.DEFINE_integer('num_stages', 2, 'K: stages, one single-core worker each.')
MICRO = flags.DEFINE_integer('num_micro_batches', 8, 'M.')
POLICY = flags.DEFINE_enum('recompute', 'always', ['always', 'except_last', 'never'], 'Policy.')
SCHEDULE = flags.DEFINE_enum(
    'schedule', 'gpipe', ['gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble'], 'Schedule.'
)
VIRTUAL = flags.DEFINE_integer('virtual_stages', 2, 'v of --schedule=interleaved_1f1b.')
LAYERS = flags.DEFINE_integer('layers', 16, 'FC layers.')
WIDTH = flags.DEFINE_integer('width', 512, 'Layer width.')
BATCH = flags.DEFINE_integer('batch_size', 2048, 'Examples per step.')
STEPS = flags.DEFINE_integer('steps', 5, 'Steps measured; the median-length one is drawn.')
OUTPUT = flags.DEFINE_string('output', 'runs/timeline.png', 'PNG to write.')
LOCAL = flags.DEFINE_bool('local', False, 'Logical CPUs in this process instead of workers.')
JSON = flags.DEFINE_bool('json', False, 'Print JSON.')


def measure(
    num_stages,
    num_micro_batches,
    recompute,
    layers,
    width,
    batch,
    steps,
    local,
    schedule='gpipe',
    virtual_stages=1,
):
    """(events [(phase, stage, micro_batch, start_s, end_s)], step span s) of a real step."""
    from bench_common import batch_input, build, family_layers, train_step

    from tf_gpipe.gpipe import trace
    from tf_gpipe.runtime import cluster as cluster_lib
    from tf_gpipe.runtime import local_cluster

    workers = None
    if local:
        cluster_lib.logical_cpus(num_stages)
        devices = [f'/device:CPU:{i}' for i in range(num_stages)]
    else:
        cores = list(range(num_stages))
        workers = local_cluster.LocalCluster(num_stages, cores=cores).start().connect()
        devices = workers.devices()
    try:
        sub, shape = family_layers('fc', layers, width=width)
        model = build(
            sub,
            shape,
            devices,
            num_micro_batches,
            recompute,
            schedule=schedule,
            virtual_stages=virtual_stages,
        )
        x = batch_input(shape, batch, devices[0])
        with trace.record() as events:
            step = train_step(model, x, trace_events=events)
            step()  # trace while recording
        runs = []
        for _ in range(steps + 1):
            _, stamps = step()
            runs.append(np.array([s.numpy() for s in stamps]))
        runs = runs[1:]  # the first run warms up
        spans = [r[:, 1].max() - r[:, 0].min() for r in runs]
        chosen = runs[int(np.argsort(spans)[len(spans) // 2])]
        t0 = chosen[:, 0].min()
        out, last_end = [], {}
        for e, (a, b) in zip(events, chosen):  # events are in each device's run order
            # Each action waits for its device's previous one (and runs between its stamps,
            # gpipe/trace.py), so this only guards the drawing against a clock step.
            device = e.stage % num_stages  # interleaved: cell c runs on device c mod K
            a = max(a, last_end.get(device, a))
            last_end[device] = b
            out.append((e.phase, e.stage, e.micro_batch, float(a - t0), float(b - t0)))
        return out, float(chosen[:, 1].max() - t0)
    finally:
        if workers is not None:
            workers.stop()


def draw(path, measured, ideal, num_stages, num_micro_batches, title, recompute='always'):
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    colors = {'F': '#4C72B0', 'B': '#DD8452', 'W': '#55A868'}
    fig, axes = plt.subplots(2, 1, figsize=(12, 1.2 + 1.1 * num_stages * 2), sharex=True)
    for ax, (label, events) in zip(axes, (('measured', measured), ('ideal', ideal))):
        for phase, stage, m, start, end in events:
            stage %= num_stages  # the device's row
            ax.broken_barh(
                [(start * 1e3, (end - start) * 1e3)],
                (num_stages - 1 - stage - 0.4, 0.8),
                facecolors=colors[phase],
                edgecolor='white',
                linewidth=0.5,
            )
            if (end - start) * 1e3 > 0.02 * max(e[4] for e in events) * 1e3:
                ax.text(
                    (start + end) / 2 * 1e3,
                    num_stages - 1 - stage,
                    str(m),
                    ha='center',
                    va='center',
                    fontsize=7,
                    color='white',
                )
        ax.set_yticks(range(num_stages))
        ax.set_yticklabels([f'device {k}' for k in reversed(range(num_stages))])
        ax.set_title(label, loc='left', fontsize=10)
    backward = {'never': 'backward B', 'always': 'recompute + backward B'}.get(
        recompute, 'backward B (recomputed unless kept)'
    )
    axes[-1].set_xlabel(
        f'ms since the step began  (blue: forward F of micro-batch m; orange: {backward}; '
        'green: weight gradient W)'
    )
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(_):
    import bench_common

    from tf_gpipe.gpipe import schedules

    k, m = STAGES.value, MICRO.value
    v = VIRTUAL.value if SCHEDULE.value == 'interleaved_1f1b' else 1
    events, span = measure(
        k,
        m,
        POLICY.value,
        LAYERS.value,
        WIDTH.value,
        BATCH.value,
        STEPS.value,
        LOCAL.value,
        SCHEDULE.value,
        v,
    )
    per_device, measured = bench_common.bubble(events, k, span)

    def mean(phase):
        # An end stamp waits for its start stamp: a duration is never negative but for a
        # clock step, counted as 0.
        times = [max(e - s, 0.0) for p, _, _, s, e in events if p == phase]
        return float(np.mean(times)) if times else 0.0

    t_f, t_b, t_w = mean('F'), mean('B'), mean('W')
    if t_f + t_b + t_w <= 0.0:  # nothing measurable: draw the ideal in unit costs
        t_f, t_b, t_w = 1.0, 2.0 if SCHEDULE.value != 'zero_bubble' else 1.0, 1.0
    sched = schedules.build(SCHEDULE.value, k, m, v)
    ideal = bench_common.ideal_events(sched, t_f, t_b, t_w)
    ideal_span = max(e[4] for e in ideal)
    expected = 1.0 - sum(e[4] - e[3] for e in ideal) / (k * ideal_span)
    title = (
        f'{SCHEDULE.value}, K={k}, M={m}, recompute={POLICY.value}: {LAYERS.value} FC x '
        f'{WIDTH.value}, batch {BATCH.value}. Bubble measured {measured:.3f}, ideal {expected:.3f}'
    )
    draw(OUTPUT.value, events, ideal, k, m, title, POLICY.value)
    result = dict(
        num_stages=k,
        num_micro_batches=m,
        schedule=SCHEDULE.value,
        recompute=POLICY.value,
        step_ms=span * 1e3,
        forward_ms=t_f * 1e3,
        backward_ms=t_b * 1e3,
        weight_ms=t_w * 1e3,
        bubble_measured=measured,
        bubble_per_device=per_device,
        bubble_ideal=expected,
        output=OUTPUT.value,
        **bench_common.run_metadata(),
    )
    if JSON.value:
        print(json.dumps(result))
        return
    print(title)
    print(
        f'step {span * 1e3:.1f} ms; mean F {t_f * 1e3:.2f} ms, mean B {t_b * 1e3:.2f} ms; idle '
        'per device ' + ', '.join(f'{b:.3f}' for b in per_device)
    )
    print(f'wrote {OUTPUT.value}')


if __name__ == '__main__':
    sys.exit(app.run(main))
