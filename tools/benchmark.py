"""The GPipe paper's Table 2 at small scale: training throughput over K and M, and overheads.

    python tools/benchmark.py                       # transformer and amoebanet, K in {1, 2}
    python tools/benchmark.py --families=fc --micro_batches=8 --json
    python tools/benchmark.py --families=fc --micro_batches=1,4 --data_parallel  # R=2 x K=1 too

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

import numpy as np

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from absl import app, flags  # noqa: E402

FAMILIES = flags.DEFINE_list('families', ['transformer', 'amoebanet'], 'transformer|amoebanet|fc')
STAGES = flags.DEFINE_integer('num_stages', 2, 'Largest K (one single-core worker per stage).')
MICRO = flags.DEFINE_list('micro_batches', ['1', '2', '4', '8', '16', '32'], 'M values.')
POLICY = flags.DEFINE_enum(
    'recompute', 'always', ['always', 'except_last', 'never'], 'Policy of the throughput table.'
)
SCHEDULES = flags.DEFINE_list(
    'schedules',
    ['gpipe'],
    'Schedules of the K>1 pipelines, all timed in one process against the same K=1 step '
    '(K=1 runs fill-drain: one stage has no bubble). gpipe|1f1b|interleaved_1f1b|zero_bubble',
)
RUNS = flags.DEFINE_integer(
    'runs', 1, 'Fresh processes per M (with --isolate); tables show the median and the spread.'
)
OUTPUT = flags.DEFINE_string('output', '', 'Also write the JSON result to this file.')
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
CELL_GRAPPLER = flags.DEFINE_bool(
    'cell_grappler', None, "PipelinedLayer.cell_grappler (default: the library's)."
)
DATA_PARALLEL = flags.DEFINE_bool(
    'data_parallel',
    False,
    'Also time data parallelism the tf.distribute way at each M: R=2 x K=1 (two single-core '
    'processes under MultiWorkerMirroredStrategy, B/2 examples each) against R=1 x K=1 (one '
    'such process), beside the pipeline R=1 x K=2 (see bench_replicas.py).',
)
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
        configs = [(1, 'gpipe')] + [
            (k, schedule) for schedule in SCHEDULES.value for k in range(2, len(devices) + 1)
        ]
        steps_fns = []
        for k, schedule in configs:
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
                cell_grappler=CELL_GRAPPLER.value,
            )
            steps_fns.append(train_step(model, x))
        for (k, schedule), t in zip(configs, median_times(steps_fns, steps)):
            rows.append(
                dict(
                    schedule=schedule,
                    num_stages=k,
                    num_micro_batches=m,
                    seconds=t,
                    examples_per_s=c['batch'] / t,
                )
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
    grappler = dict(cell_grappler=CELL_GRAPPLER.value)
    fns = [train_step(build(sub, shape, [device], **kw, **grappler), x) for _, kw in configs]
    times = median_times(fns, steps)
    return [dict(name=n, seconds=t, vs_plain=t / times[0]) for (n, _), t in zip(configs, times)]


def _measure_here(family, micro, with_overheads):
    """(throughput rows, overhead rows) measured with workers started by this process."""
    from tf_gpipe.runtime import local_cluster

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
    from bench_common import given

    rows, over = [], []
    parts = [([m], False) for m in micro for _ in range(RUNS.value)]
    parts += [([], True)] if with_overheads else []
    for run_index, (part_micro, part_over) in enumerate(parts):
        args = [
            f'--families={family}',
            f'--micro_batches={",".join(str(m) for m in part_micro)}',
            f'--overheads={part_over}',
            '--isolate=false',
            '--json',
        ]
        flags_ = (STAGES, POLICY, VIRTUAL, OVERHEAD_M, STEPS, PARTITION_BY, KNOB, BATCH)
        flags_ += (CELL_GRAPPLER,)
        args += given(*flags_)
        args.append(f'--schedules={",".join(SCHEDULES.value)}')
        run = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True
        )
        if run.returncode:
            raise RuntimeError(f'benchmark {" ".join(args)} failed:\n{run.stderr[-3000:]}')
        result = json.loads(run.stdout.strip().splitlines()[-1])[0]
        rows += [dict(r, run=run_index) for r in result['throughput']]
        over += result['overheads']
    return rows, over


def measure(family):
    from bench_common import library_default

    micro = [int(m) for m in MICRO.value]
    measure_fn = _measure_isolated if ISOLATE.value else _measure_here
    runs, over = measure_fn(family, micro, OVERHEADS.value)
    runs = [dict(r, run=r.get('run', 0)) for r in runs]
    # Ratios are taken within one run (one process: the same machine state), then summarised
    # over the runs: median, min and max.
    k1 = {(r['run'], r['num_micro_batches']): r for r in runs if r['num_stages'] == 1}
    for r in runs:
        if r['num_stages'] > 1:
            r['speedup'] = k1[(r['run'], r['num_micro_batches'])]['seconds'] / r['seconds']
    groups = {}
    for r in runs:
        groups.setdefault((r['schedule'], r['num_stages'], r['num_micro_batches']), []).append(r)
    rows = []
    for (schedule, k, m), rs in groups.items():
        t = [r['seconds'] for r in rs]
        row = dict(
            schedule=schedule,
            num_stages=k,
            num_micro_batches=m,
            runs=len(rs),
            seconds=float(np.median(t)),
            seconds_spread=[min(t), max(t)],
        )
        row['examples_per_s'] = _config(family)['batch'] / row['seconds']
        if k > 1:
            ups = [r['speedup'] for r in rs]
            row.update(
                speedup=float(np.median(ups)),
                speedup_spread=[min(ups), max(ups)],
                bubble_bound=_bound(schedule, k, m),
            )
            row['efficiency'] = row['speedup'] / row['bubble_bound']
        rows.append(row)
    by = {(r['schedule'], r['num_stages'], r['num_micro_batches']): r for r in rows}
    # The paper's baseline is K=2, M=1; without M=1 in the grid, the smallest M measured.
    first = SCHEDULES.value[0]
    base = by.get((first, 2, 1), by.get(('gpipe', 1, 1)))
    if base is None and rows:
        base = min(rows, key=lambda r: (r['num_micro_batches'], r['num_stages']))
    for r in rows:
        r['normalised'] = r['examples_per_s'] / base['examples_per_s']
    c = _config(family)
    data_parallel = _data_parallel(family, micro, by) if DATA_PARALLEL.value else []
    return dict(
        family=family,
        knob=c['knob'],
        batch_size=c['batch'],
        config=c['overrides'],
        recompute=POLICY.value,
        schedules=list(SCHEDULES.value),
        virtual_stages=VIRTUAL.value,
        partition_by=PARTITION_BY.value,
        cell_grappler=library_default('cell_grappler', CELL_GRAPPLER.value),
        baseline=base
        and dict(
            schedule=base['schedule'],
            num_stages=base['num_stages'],
            num_micro_batches=base['num_micro_batches'],
        ),
        throughput=rows,
        overheads=over,
        data_parallel=data_parallel,
    )


def _data_parallel(family, micro, pipeline_rows):
    """Rows per M: R=1 and R=2 (K=1) step seconds and examples/s, R=2's speed-up over R=1
    (within each run, then median and spread), and the pipeline's K=2 speed-up at that M."""
    import bench_replicas

    runs = bench_replicas.measure(
        family, _config(family), micro, POLICY.value, STEPS.value, RUNS.value
    )
    batch = _config(family)['batch']
    out = []
    for m in micro:
        rs = [r for r in runs if r['num_micro_batches'] == m]
        r1 = float(np.median([r['seconds_r1'] for r in rs]))
        r2 = float(np.median([r['seconds_r2'] for r in rs]))
        ups = [r['seconds_r1'] / r['seconds_r2'] for r in rs]
        pipe = pipeline_rows.get((SCHEDULES.value[0], 2, m), {})
        out.append(
            dict(
                num_micro_batches=m,
                runs=len(rs),
                seconds_r1=r1,
                seconds_r2=r2,
                examples_per_s_r1=batch / r1,
                examples_per_s_r2=batch / r2,
                speedup_r2=float(np.median(ups)),
                speedup_r2_spread=[min(ups), max(ups)],
                pipeline_speedup_k2=pipe.get('speedup'),
                pipeline_examples_per_s_k2=pipe.get('examples_per_s'),
            )
        )
    return out


def _bound(schedule, k, m):
    """Ideal speed-up of the K-stage schedule over K=1 at equal stage costs (unit F, B = 2F,
    or B = W = F when split): K * (work of one stage) / simulated makespan."""
    from tf_gpipe.gpipe import schedules

    v = VIRTUAL.value if schedule == 'interleaved_1f1b' else 1
    sched = schedules.build(schedule, k, m, v)
    sim = schedules.simulate(sched)
    return k * sim.busy[0] / sim.makespan


def _print(result):
    print(
        f'\n{result["family"]} (knob {result["knob"]}, {result["config"]}), batch '
        f'{result["batch_size"]}, recompute={result["recompute"]}, '
        f'partition_by={result["partition_by"]}, one single-core worker per stage'
    )
    rows = result['throughput']
    if rows:
        b = result['baseline']
        runs = max(r['runs'] for r in rows)
        print(
            f'normalised throughput ({b["schedule"]} K={b["num_stages"]}, '
            f'M={b["num_micro_batches"]} = 1.00; the paper uses K=2, M=1), examples/s, and for '
            f'K>1 the speed-up over K=1 at the same M (median of {runs} run(s) [min-max]), the '
            "schedule's ideal bound and efficiency = speed-up / bound"
        )
        print(
            f'{"schedule":<18}{"K":>3}{"M":>4}{"norm.":>8}{"ex/s":>9}{"speed-up":>10}'
            f'{"[min-max]":>14}{"bound":>7}{"eff.":>7}'
        )
        for r in sorted(
            rows,
            key=lambda r: (
                r['num_micro_batches'],
                r['num_stages'] > 1,
                result['schedules'].index(r['schedule'])
                if r['schedule'] in result['schedules']
                else -1,
                r['num_stages'],
            ),
        ):
            line = (
                f'{r["schedule"]:<18}{r["num_stages"]:>3}{r["num_micro_batches"]:>4}'
                f'{r["normalised"]:>8.2f}{r["examples_per_s"]:>9.1f}'
            )
            if r['num_stages'] > 1:
                lo, hi = r['speedup_spread']
                line += (
                    f'{r["speedup"]:>10.2f}{f"[{lo:.2f}-{hi:.2f}]":>14}'
                    f'{r["bubble_bound"]:>7.2f}{r["efficiency"]:>7.2f}'
                )
            print(line)
    if result.get('data_parallel'):
        print(
            f'data parallelism vs pipeline on two single-core processes, K=1 or 2 (median of '
            f'{result["data_parallel"][0]["runs"]} run(s) [min-max]). R=2 x K=1: two processes '
            'under MultiWorkerMirroredStrategy, B/2 each, against R=1 x K=1 in one process; '
            f'R=1 x K=2: the {result["schedules"][0]} rows above (a client driving two workers, '
            'against K=1 on one of them)'
        )
        print(
            f'{"M":>4}{"R1K1 ex/s":>11}{"R2K1 ex/s":>11}{"R2K1 speed-up":>15}{"[min-max]":>14}'
            f'{"R1K2 ex/s":>11}{"R1K2 speed-up":>15}'
        )
        for r in result['data_parallel']:
            lo, hi = r['speedup_r2_spread']
            k2 = r['pipeline_speedup_k2']
            k2_rate = r['pipeline_examples_per_s_k2']
            print(
                f'{r["num_micro_batches"]:>4}{r["examples_per_s_r1"]:>11.1f}'
                f'{r["examples_per_s_r2"]:>11.1f}{r["speedup_r2"]:>15.2f}'
                f'{f"[{lo:.2f}-{hi:.2f}]":>14}'
                + (f'{k2_rate:>11.1f}{k2:>15.2f}' if k2 is not None else f'{"-":>11}{"-":>15}')
            )
    if result['overheads']:
        print('overheads on one worker (step seconds, ratio to the plain sequence):')
        for r in result['overheads']:
            print(f'  {r["name"]:<22}{r["seconds"]:>9.3f} s{r["vs_plain"]:>8.3f}')


def main(_):
    from tf_gpipe.gpipe import schedules

    for name in SCHEDULES.value:
        schedules.build(name, 2, 2 * max(2, VIRTUAL.value))  # an unknown name: did you mean ...
    from bench_common import run_metadata

    results = [dict(measure(f), **run_metadata()) for f in FAMILIES.value]
    if OUTPUT.value:
        from bench_common import write_json

        write_json(OUTPUT.value, results)
    if JSON.value:
        print(json.dumps(results))
        return
    for r in results:
        _print(r)


if __name__ == '__main__':
    app.run(main)
