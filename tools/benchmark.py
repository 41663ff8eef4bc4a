"""The GPipe paper's Table 2 at small scale: training throughput over K and M, and overheads.

    python tools/benchmark.py                       # transformer and amoebanet, K in {1, 2}
    python tools/benchmark.py --families=fc --micro_batches=8 --json

Every stage is its own TF worker process on 127.0.0.1, pinned to one core (taskset, one
intra-op thread); this process is the client, and every op of the step — input, cells, loss,
update — runs on a worker (the plain sequence wholly on worker 0). Cells are cut by
--partition_by, by default each layer's measured forward + backward time: on CPU the
backward of a convolution costs far more than its flops say, so a flops split of AmoebaNet
leaves the first stage with most of the work. For each model family and M, a training step (forward, backward, SGD update) is timed
for K=1 (every layer on worker 0) and K=2..num_stages, alternating the step functions so that
drift in the machine's load hits all alike (median of --steps). Printed per family:

- throughput table: examples/s, normalised to K=2, M=1 as in the paper, and for K>1 the
  speed-up over K=1 at the same M, the bubble bound K*M/(M+K-1) and efficiency = speed-up/bound;
- overheads on one worker: PipelinedLayer K=1, M=1, recompute='never' against the plain layer
  sequence's step (target <= 1.05), and each recompute policy at M=1 and at M=8 (the cost of
  micro-batching itself is M=8 over M=1 with the same policy).
"""

import json
import os
import subprocess
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from absl import app, flags  # noqa: E402

FAMILIES = flags.DEFINE_list('families', ['transformer', 'amoebanet'], 'transformer|amoebanet|fc')
STAGES = flags.DEFINE_integer('num_stages', 2, 'Largest K (one single-core worker per stage).')
MICRO = flags.DEFINE_list('micro_batches', ['1', '2', '4', '8', '16', '32'], 'M values.')
POLICY = flags.DEFINE_enum(
    'recompute', 'always', ['always', 'except_last', 'never'], 'Policy of the throughput table.'
)
SCHEDULE = flags.DEFINE_enum(
    'schedule',
    'gpipe',
    ['gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble'],
    'Schedule of the K>1 pipelines (K=1 always runs fill-drain: one stage has no bubble).',
)
VIRTUAL = flags.DEFINE_integer('virtual_stages', 2, 'v for --schedule=interleaved_1f1b.')
OVERHEAD_M = flags.DEFINE_integer('overhead_micro_batches', 8, 'M of the overhead rows.')
STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps per configuration (after 2 warm-ups).')
OVERHEADS = flags.DEFINE_bool('overheads', True, 'Also measure the overhead rows.')
PARTITION_BY = flags.DEFINE_enum(
    'partition_by',
    'time',
    ['time', 'flops', 'params', 'activation_bytes', 'uniform'],
    "The partitioner's cost (time: each layer's forward + backward, measured here).",
)
KNOB = flags.DEFINE_integer('knob', 0, "Model size knob (0: the family's default below).")
BATCH = flags.DEFINE_integer('batch_size', 0, "Examples per step (0: the family's default).")
JSON = flags.DEFINE_bool('json', False, 'Print JSON.')
ISOLATE = flags.DEFINE_bool(
    'isolate',
    True,
    'Measure each M (and the overhead rows) in a fresh process with fresh workers: a worker '
    'keeps every function it has run, and later configurations in one process measured slower.',
)

# Sizes per family: a K=1 step of a fraction of a second to a few seconds on one core.
CONFIGS = {
    'transformer': dict(knob=4, batch=64, overrides=dict(seq_len=64)),
    'amoebanet': dict(knob=1, batch=64, overrides=dict(image_size=32)),
    'fc': dict(knob=16, batch=2048, overrides=dict(width=512)),
}


def _config(family):
    c = dict(CONFIGS[family])
    c['knob'] = KNOB.value or c['knob']
    c['batch'] = BATCH.value or c['batch']
    return c


def throughput(family, devices, micro_batches, policy, steps):
    """Rows {num_stages, num_micro_batches, seconds, examples_per_s} for K = 1..len(devices)."""
    from bench_common import batch_input, build, family_layers, median_times, train_step

    c = _config(family)
    sub, shape = family_layers(family, c['knob'], **c['overrides'])
    x = batch_input(shape, c['batch'], devices[0])
    rows = []
    for m in micro_batches:
        ks = list(range(1, len(devices) + 1))
        steps_fns = []
        for k in ks:
            schedule = SCHEDULE.value if k > 1 else 'gpipe'
            v = VIRTUAL.value if schedule == 'interleaved_1f1b' else 1
            model = build(
                sub,
                shape,
                devices[:k],
                m,
                policy,
                partition_by=PARTITION_BY.value,
                schedule=schedule,
                virtual_stages=v,
            )
            steps_fns.append(train_step(model, x))
        for k, t in zip(ks, median_times(steps_fns, steps)):
            rows.append(
                dict(num_stages=k, num_micro_batches=m, seconds=t, examples_per_s=c['batch'] / t)
            )
    return rows


def overheads(family, device, m, steps):
    """Rows {name, seconds, vs_plain} on one worker: plain, and every policy at M=1 and M=m."""
    from bench_common import batch_input, build, family_layers, median_times, train_step

    c = _config(family)
    sub, shape = family_layers(family, c['knob'], **c['overrides'])
    x = batch_input(shape, c['batch'], device)
    configs = [('plain sequence', dict(plain=True))]
    for policy in ('never', 'except_last', 'always'):
        for mm in (1, m):
            configs.append((f'K=1 M={mm} {policy}', dict(num_micro_batches=mm, recompute=policy)))
    fns = [train_step(build(sub, shape, [device], **kw), x) for _, kw in configs]
    times = median_times(fns, steps)
    return [dict(name=n, seconds=t, vs_plain=t / times[0]) for (n, _), t in zip(configs, times)]


def _measure_here(family, micro, with_overheads):
    """(throughput rows, overhead rows) measured with workers started by this process."""
    from tf_gpipe import local_cluster

    k_max = STAGES.value
    with local_cluster.LocalCluster(k_max, cores=list(range(k_max))) as cluster:
        cluster.connect()
        devices = cluster.devices()
        rows = throughput(family, devices, micro, POLICY.value, STEPS.value)
        over = (
            overheads(family, devices[0], OVERHEAD_M.value, STEPS.value) if with_overheads else []
        )
    return rows, over


def _measure_isolated(family, micro, with_overheads):
    """As _measure_here, each M (and the overhead rows) in a fresh client with fresh workers."""
    rows, over = [], []
    parts = [([m], False) for m in micro] + ([([], True)] if with_overheads else [])
    for part_micro, part_over in parts:
        args = [
            f'--families={family}',
            f'--micro_batches={",".join(str(m) for m in part_micro)}',
            f'--overheads={part_over}',
            '--isolate=false',
            '--json',
        ]
        flags_ = (STAGES, POLICY, SCHEDULE, VIRTUAL, OVERHEAD_M, STEPS, PARTITION_BY, KNOB, BATCH)
        for flag in flags_:
            args.append(f'--{flag.name}={flag.value}')
        run = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True
        )
        if run.returncode:
            raise RuntimeError(f'benchmark {" ".join(args)} failed:\n{run.stderr[-3000:]}')
        result = json.loads(run.stdout.strip().splitlines()[-1])[0]
        rows += result['throughput']
        over += result['overheads']
    return rows, over


def measure(family):
    micro = [int(m) for m in MICRO.value]
    measure_fn = _measure_isolated if ISOLATE.value else _measure_here
    rows, over = measure_fn(family, micro, OVERHEADS.value)
    by = {(r['num_stages'], r['num_micro_batches']): r for r in rows}
    # The paper's baseline is K=2, M=1; without M=1 in the grid, the smallest M measured.
    base = by.get((2, 1), by.get((1, 1)))
    if base is None and rows:
        base = min(rows, key=lambda r: r['num_micro_batches'])
    for r in rows:
        k, m = r['num_stages'], r['num_micro_batches']
        r['normalised'] = r['examples_per_s'] / base['examples_per_s']
        if k > 1:
            r['speedup'] = by[(1, m)]['seconds'] / r['seconds']
            r['bubble_bound'] = _bound(k, m)
            r['efficiency'] = r['speedup'] / r['bubble_bound']
    c = _config(family)
    return dict(
        family=family,
        knob=c['knob'],
        batch_size=c['batch'],
        config=c['overrides'],
        recompute=POLICY.value,
        schedule=SCHEDULE.value,
        virtual_stages=VIRTUAL.value if SCHEDULE.value == 'interleaved_1f1b' else 1,
        partition_by=PARTITION_BY.value,
        baseline=base
        and dict(num_stages=base['num_stages'], num_micro_batches=base['num_micro_batches']),
        throughput=rows,
        overheads=over,
    )


def _bound(k, m):
    """Ideal speed-up of the K-stage schedule over K=1 at equal stage costs (unit F, B = 2F,
    or B = W = F when split): K * (work of one stage) / simulated makespan."""
    from tf_gpipe.gpipe import schedules

    v = VIRTUAL.value if SCHEDULE.value == 'interleaved_1f1b' else 1
    sched = schedules.build(SCHEDULE.value, k, m, v)
    sim = schedules.simulate(sched)
    return k * sim.busy[0] / sim.makespan


def _print(result):
    print(
        f'\n{result["family"]} (knob {result["knob"]}, {result["config"]}), batch '
        f'{result["batch_size"]}, schedule={result["schedule"]} (v={result["virtual_stages"]}), '
        f'recompute={result["recompute"]}, '
        f'partition_by={result["partition_by"]}, one single-core worker per stage'
    )
    rows = result['throughput']
    if rows:
        micro = sorted({r['num_micro_batches'] for r in rows})
        ks = sorted({r['num_stages'] for r in rows})
        by = {(r['num_stages'], r['num_micro_batches']): r for r in rows}
        b = result['baseline']
        print(
            f'normalised throughput (K={b["num_stages"]}, M={b["num_micro_batches"]} = 1.00; the '
            'paper uses K=2, M=1); examples/s in brackets'
        )
        print(f'{"":>8}' + ''.join(f'{"M=" + str(m):>16}' for m in micro))
        for k in ks:
            cells = ''.join(
                f'{by[(k, m)]["normalised"]:>7.2f} ({by[(k, m)]["examples_per_s"]:>6.1f})'
                for m in micro
            )
            print(f'{"K=" + str(k):>8}{cells}')
        for k in ks[1:]:
            print(f"K={k} vs K=1 at the same M: speed-up / the schedule's bound = efficiency")
            for m in micro:
                r = by[(k, m)]
                print(
                    f'{"M=" + str(m):>8}  {r["speedup"]:.2f} / {r["bubble_bound"]:.2f} = '
                    f'{r["efficiency"]:.2f}'
                )
    if result['overheads']:
        print('overheads on one worker (step seconds, ratio to the plain sequence):')
        for r in result['overheads']:
            print(f'  {r["name"]:<22}{r["seconds"]:>9.3f} s{r["vs_plain"]:>8.3f}')


def main(_):
    results = [measure(f) for f in FAMILIES.value]
    if JSON.value:
        print(json.dumps(results))
        return
    for r in results:
        _print(r)


if __name__ == '__main__':
    app.run(main)
