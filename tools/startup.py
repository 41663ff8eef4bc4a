"""Start-up of a pipelined training step against the plain layer sequence's: trace, first call,
graph size and steady step, over K, M, L and the schedules.

    python tools/startup.py --output=/tmp/grid.json   # the whole grid (hours; `make startup-grid`)
    python tools/startup.py --num_stages=4 --micro_batches=4,32 --layers=16 --schedules=1f1b
    python tools/startup.py --notick_loop ...   # the unrolled executor (tick_loop=False)
    python tools/startup.py --compare_unrolled --dim=256 ...   # both engines, larger cells
    python tools/startup.py --measure=eval --compare_unrolled ...   # eval's forward (FProp)
    python tools/startup.py --measure=fprop --compare_unrolled ...   # FProp under a tape
    python tools/startup.py --workers --compare_unrolled --num_stages=2 ...   # TF workers
    python tools/startup.py --grappler_passes ...   # also what Grappler did at each first call
    python tools/startup.py --summarise=docs/results/startup_grid_l8.json   # summary again

Each (K, L, M) and schedule runs in a fresh process with K logical CPUs (--workers: K TF
worker processes on 127.0.0.1, one core each): a warm-up op, then the plain sequence's tape
step (one device), then the schedule's `ComputeGradients` step (and the unrolled executor's
with --compare_unrolled), all on a
Transformer stack (d=--dim, 2 heads, hidden 2d, batch 64 x 16 tokens). Per step: trace seconds
(`get_concrete_function`; of them, the seconds in Python's garbage collections and how many
were full ones), first-call seconds (wall clock, and the process's CPU time in the
rows: steadier on a shared host), nodes of the outer graph and of its function
library, and the steady step (median of --steps calls). Printed: start-up (trace + first call)
per M, its growth from the smallest to the largest M, the ratio to the plain step's at the
largest M, and the nodes each extra micro-batch adds.
"""

import gc
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from absl import app, flags  # noqa: E402

STAGES = flags.DEFINE_list('num_stages', ['2', '4', '8'], 'K values.')
MICRO = flags.DEFINE_list('micro_batches', ['4', '8', '16', '32'], 'M values.')
LAYERS = flags.DEFINE_list('layers', ['8', '16', '64'], 'L values (Transformer layers).')
SCHEDULES = flags.DEFINE_list(
    'schedules', ['gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble'], 'Schedules.'
)
POLICY = flags.DEFINE_enum(
    'recompute', 'except_last', ['always', 'except_last', 'never'], 'Recompute policy.'
)
TICK_LOOP = flags.DEFINE_bool(
    'tick_loop',
    True,
    'PipelinedLayer.tick_loop=True: the schedule as a loop over clock ticks (the library '
    "default's choice from M=8 in one process); --notick_loop: the unrolled executor.",
)
TWINS = flags.DEFINE_bool(
    'twin_cells',
    None,
    "PipelinedLayer.twin_cells (default: the library's): --twin_cells: cells of the same "
    'layers trace their backward once; --notwin_cells: every cell traces its own.',
)
CELL_GRAPPLER = flags.DEFINE_bool(
    'cell_grappler',
    None,
    "PipelinedLayer.cell_grappler (default: the library's): --cell_grappler runs Grappler "
    "on the cells' functions too, a longer first call.",
)
STEP_GRAPPLER = flags.DEFINE_bool(
    'step_grappler',
    True,
    "--nostep_grappler: Grappler off for the whole process, the plain step's and the "
    "pipeline's step's own graphs too (an experiment, not a library setting: what Grappler's "
    'pass over a step costs at its first call).',
)
GRAPPLER_PASSES = flags.DEFINE_bool(
    'grappler_passes',
    False,
    "Also record what Grappler did at each step's first call, from TF's own log "
    "(grappler_log.py): its seconds, the graph's nodes before and after, each pass's time.",
)
COMPARE = flags.DEFINE_bool(
    'compare_unrolled',
    False,
    'Also measure the unrolled executor in the same process (its start-up '
    "and steady step at the largest M, beside the loop's).",
)
MEASURE = flags.DEFINE_enum(
    'measure',
    'train',
    ['train', 'fprop', 'eval'],
    "train: a ComputeGradients step per schedule; fprop: gpipe's FProp under a tape "
    "(loops: forward_loop.py and backward_loop.py); eval: eval's forward (FProp in eval mode, "
    "its loop on by default: --tick_loop picks it here). The schedule column reads 'fprop' or "
    "'eval' then.",
)
WORKERS = flags.DEFINE_bool(
    'workers',
    False,
    'Each stage on its own TF worker process (127.0.0.1, one core each, as tools/benchmark.py) '
    'instead of K logical CPUs of one process: what a loop costs when its ticks cross '
    'processes.',
)
DIM = flags.DEFINE_integer('dim', 32, 'Model dimension d of the Transformer layers (hidden 2d).')
STEPS = flags.DEFINE_integer('steps', 5, 'Steady-step calls timed (median) after the first.')
BATCH = flags.DEFINE_integer('batch_size', 64, 'Examples per step.')
OUTPUT = flags.DEFINE_string('output', '', 'Also write the JSON result to this file.')
LABEL = flags.DEFINE_string(
    'label',
    '',
    "Put before the engine's name in the result: what else the run measured (e.g. the commit "
    'of the library, when this tool is run from an older checkout).',
)
REPEATS = flags.DEFINE_integer(
    'repeats',
    1,
    'Fresh processes per (K, L, M), run round after round over M (a busy moment then slows '
    "every M alike): the table shows each start-up's median and range, each ratio the median "
    "of the rounds' ratios.",
)
CHILD = flags.DEFINE_string('child', '', 'Internal: "K,L,M" measured in this process.')
SUMMARISE = flags.DEFINE_string(
    'summarise',
    '',
    "Measure nothing: rewrite this result file's summary from its rows with this tool's "
    'summarise (a file written before a summary field existed gets it).',
)

HEADS, SEQ = 2, 16


def _measure(step, args):
    """Start-up and graph size of `step`; returns (row, a call of the step for the steady
    rounds)."""
    import tensorflow as tf

    fn = tf.function(step)
    collections = _CollectionClock()
    # Process CPU time beside wall time: on a shared host the wall clock also counts the time
    # others took the cores (one commit's start-up at M=32, K=4, L=64: medians 48.3 and 65.8 s
    # in two runs 45 minutes apart), the CPU time less so. The first call's counts every
    # thread of the process (its one step's too); with --workers, this client's alone.
    c0, t0 = time.process_time(), time.perf_counter()
    with collections:
        concrete = fn.get_concrete_function(*args)
    c1, t1 = time.process_time(), time.perf_counter()
    tf.nest.map_structure(lambda t: t.numpy(), fn(*args))
    c2, t2 = time.process_time(), time.perf_counter()
    graph = concrete.graph.as_graph_def()
    row = dict(
        trace_s=t1 - t0,
        first_call_s=t2 - t1,
        startup_s=t2 - t0,
        trace_cpu_s=c1 - c0,
        first_call_cpu_s=c2 - c1,
        trace_gc_s=collections.seconds,  # in Python's garbage collections, of trace_s
        trace_full_gcs=collections.full,  # of them generation-2 (whole-heap) collections
        function=tf.compat.as_str(concrete.name),  # Grappler's item name in TF's log
        outer_nodes=len(graph.node),
        library_nodes=sum(len(f.node_def) for f in graph.library.function),
    )
    return row, lambda: tf.nest.map_structure(lambda t: t.numpy(), fn(*args))


class _CollectionClock:
    """Seconds spent in Python's garbage collections inside the `with` body, and how many of
    them were full (generation 2): each of those scans every object the process tracks."""

    def __init__(self):
        self.seconds, self.full, self._start = 0.0, 0, None

    def _callback(self, phase, info):
        if phase == 'start':
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.full += info['generation'] == 2
            self._start = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


def _schedules():
    """The rows' schedules: --schedules when training, else the measured call ('eval',
    'fprop': gpipe's forward or FProp, one per (K, L, M))."""
    return SCHEDULES.value if MEASURE.value == 'train' else [MEASURE.value]


def _runs(schedule, k, num_layers, m):
    """Whether `schedule` runs at (K, L, M): interleaved_1f1b needs 2K cells of a layer at
    least and M a multiple of K."""
    v = 2 if schedule == 'interleaved_1f1b' else 1
    return k * v <= num_layers and not (v > 1 and m % k)


def _steady_rounds(measured):
    """Times every step once per round, round after round (so that a busy moment slows
    all of them alike): each row's steady_s is its median, steady_all its every time."""
    times = [[] for _ in measured]
    for _ in range(STEPS.value):
        for i, (_, call) in enumerate(measured):
            start = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - start)
    for (row, _), seen in zip(measured, times):
        row.update(steady_s=float(sorted(seen)[len(seen) // 2]), steady_all=seen)


def _step_grappler():
    """--nostep_grappler: Grappler off for every graph this process runs (set once TF's
    devices are configured)."""
    if not STEP_GRAPPLER.value:
        import tensorflow as tf

        tf.config.optimizer.set_experimental_options({'disable_meta_optimizer': True})


def _child(spec):
    k, num_layers, m = (int(v) for v in spec.split(','))
    from tf_gpipe.runtime import cluster, local_cluster

    if not WORKERS.value:
        cluster.logical_cpus(k)
        _step_grappler()
        return _measure_all(k, num_layers, m, None)
    _step_grappler()
    cores = os.cpu_count() or 1
    with local_cluster.LocalCluster(k, cores=[i % cores for i in range(k)]) as workers:
        _measure_all(k, num_layers, m, workers.connect().devices())


def _measure_all(k, num_layers, m, devices):
    import tensorflow as tf

    from tf_gpipe import fprop_context, gpipe, layers
    from tf_gpipe.nested_map import NestedMap

    first, last = (devices[0], devices[-1]) if devices else (None, None)
    # On workers every op is placed on one (an unplaced op would run on this client).
    with tf.device(first):
        tf.function(lambda: tf.reduce_sum(tf.ones([4, 4]) @ tf.ones([4, 4])))()  # warm-up
        dim = DIM.value
        tr = layers.TransformerLayer.Params().Set(
            input_dim=dim, num_heads=HEADS, hidden_dim=2 * dim
        )
        sub = [tr.Copy().Set(name=f'tr{i}') for i in range(num_layers)]
        x = NestedMap(
            vecs=tf.random.stateless_normal([BATCH.value, SEQ, dim], [1, 1]),
            paddings=tf.zeros([BATCH.value, SEQ]),
        )
        targets = tf.random.stateless_normal([BATCH.value, SEQ, dim], [2, 2])
        plain = layers.SequentialLayer.Params().Set(name='plain', sub=sub).Instantiate()

    def loss_fn(out, t):
        return tf.reduce_mean(tf.reduce_sum(out.vecs * t, -1))

    def plain_step(x, t):
        with tf.device(first):
            if MEASURE.value == 'eval':
                with fprop_context.eval_mode():
                    return plain.FProp(x).vecs
            with tf.GradientTape() as tape:
                loss = loss_fn(plain.FProp(x), t)
            return loss, tape.gradient(loss, plain.trainable_variables)

    measured = [_measure(plain_step, (x, targets))]
    measured[0][0].update(kind='plain', schedule='')
    engines = [(TICK_LOOP.value, 'pipeline')]
    if TICK_LOOP.value and COMPARE.value:
        engines.append((False, 'unrolled'))
    for schedule, (loop, kind) in [(s, e) for s in _schedules() for e in engines]:
        if not _runs(schedule, k, num_layers, m):
            continue
        v = 2 if schedule == 'interleaved_1f1b' else 1
        pipe = (
            gpipe.PipelinedLayer.Params()
            .Set(
                name='pipe',
                sub=sub,
                num_partitions=k,
                partition_by='uniform',
                num_micro_batches=m,
                recompute=POLICY.value,
                schedule='gpipe' if schedule in ('eval', 'fprop') else schedule,
                virtual_stages=v,
                tick_loop=loop,
                eval_loop=loop,
                devices=devices,
            )
            .Set(**{f.name: f.value for f in (TWINS, CELL_GRAPPLER) if f.value is not None})
            .Instantiate()
        )

        def pipe_step(x, t, pipe=pipe):
            if MEASURE.value == 'eval':
                with fprop_context.eval_mode():
                    out = pipe.FProp(x).vecs
                with tf.device(last):
                    return tf.identity(out)
            if MEASURE.value == 'fprop':
                with tf.GradientTape() as tape:
                    out = pipe.FProp(x)
                    with tf.device(last):
                        loss = loss_fn(out, t)
                return loss, tape.gradient(loss, pipe.trainable_variables)
            return pipe.ComputeGradients(x, t, loss_fn)

        measured.append(_measure(pipe_step, (x, targets)))
        measured[-1][0].update(kind=kind, schedule=schedule)
    _steady_rounds(measured)
    rows = [row for row, _ in measured]
    # As TF reports it, not as asked: whether Grappler ran on this process's graphs.
    off = bool(tf.config.optimizer.get_experimental_options().get('disable_meta_optimizer'))
    for r in rows:
        r.update(num_stages=k, layers=num_layers, num_micro_batches=m, step_grappler=not off)
    print(json.dumps(rows))


def _attach_grappler(rows, items):
    """Each row's Grappler record (grappler_log.parse) by its step's function name; a step
    that ran Grappler and has none means TF's log no longer reads as grappler_log expects."""
    for r in rows:
        r['grappler'] = items.get(r['function'])
        if r['grappler'] is None and r['step_grappler']:
            sys.exit(
                f"--grappler_passes: TF's log shows no Grappler pass over {r['function']} "
                f'({r["kind"]} {r["schedule"]}); known items: {sorted(items)}. If TF changed '
                "its meta optimizer's log lines, update tools/grappler_log.py."
            )


def summarise(rows):
    """Per (L, K, schedule): start-up per M, growth, ratio to plain, nodes per micro-batch;
    with several runs (`--repeats`), medians over the runs (ratios within each run first)."""
    out = []
    keys = sorted({(r['layers'], r['num_stages'], r['schedule']) for r in rows if r['schedule']})
    runs = sorted({r.get('run', 0) for r in rows})
    for num_layers, k, schedule in keys:
        where = (num_layers, k, schedule)
        mine = [_by_m(rows, 'pipeline', run, *where) for run in runs]
        plain = [_by_m(rows, 'plain', run, num_layers, k, None, beside=schedule) for run in runs]
        unrolled = [_by_m(rows, 'unrolled', run, *where) for run in runs]
        ms = sorted(mine[0])
        lo, hi = ms[0], ms[-1]
        per_mb = (
            (mine[0][hi]['outer_nodes'] - mine[0][lo]['outer_nodes']) / (hi - lo)
            if hi > lo
            else None
        )

        def net(r):  # the first call runs one step: start-up without it
            return r['startup_s'] - r['steady_s']

        out.append(
            dict(
                layers=num_layers,
                num_stages=k,
                schedule=schedule,
                startup_s={str(m): _median([x[m]['startup_s'] for x in mine]) for m in ms},
                growth=_median([x[hi]['startup_s'] / x[lo]['startup_s'] for x in mine]),
                growth_net_of_step=_median([net(x[hi]) / net(x[lo]) for x in mine]),
                # The same over the plain step of each process: the host's speed drifts between
                # processes, and the plain step (which does not depend on M) drifts with it.
                growth_vs_plain=_median(
                    [
                        (x[hi]['startup_s'] / p[hi]['startup_s'])
                        / (x[lo]['startup_s'] / p[lo]['startup_s'])
                        for x, p in zip(mine, plain)
                    ]
                ),
                vs_plain=_median(
                    [x[hi]['startup_s'] / p[hi]['startup_s'] for x, p in zip(mine, plain)]
                ),
                plain_startup_s=_median([p[hi]['startup_s'] for p in plain]),
                nodes_per_micro_batch=per_mb,
                steady_ms=1e3 * _median([x[hi]['steady_s'] for x in mine]),
                plain_steady_ms=1e3 * _median([p[hi]['steady_s'] for p in plain]),
                smallest_m=lo,
                largest_m=hi,
            )
        )
        if len(runs) > 1:
            out[-1].update(
                runs=len(runs),
                startup_range={
                    str(m): [
                        min(x[m]['startup_s'] for x in mine),
                        max(x[m]['startup_s'] for x in mine),
                    ]
                    for m in ms
                },
                steady_ms_smallest_m=1e3 * _median([x[lo]['steady_s'] for x in mine]),
            )
        if hi in unrolled[0]:  # the unrolled executor, same process and M
            # Per round, the loop's step over the unrolled one's (timed back to back).
            ratios = sorted(
                a / b
                for x, u in zip(mine, unrolled)
                for a, b in zip(x[hi]['steady_all'], u[hi]['steady_all'])
            )
            out[-1].update(
                unrolled_startup_s=_median([u[hi]['startup_s'] for u in unrolled]),
                unrolled_steady_ms=1e3 * _median([u[hi]['steady_s'] for u in unrolled]),
                steady_ratio=ratios[len(ratios) // 2],
                steady_ratio_range=[ratios[0], ratios[-1]],
            )
    return out


def _summarise_file(path, bench_common):
    """Rewrites `path`'s summary from its rows (the measurements are left as they are)."""
    with open(path) as f:
        result = json.load(f)
    if not result.get('startup'):
        sys.exit(f'{path} is not a result of tools/startup.py (no "startup" key).')
    result['summary'] = summarise(result['rows'])
    when = bench_common.run_metadata()['date']
    result['summarised'] = f'python tools/startup.py --summarise={path} ({when})'
    bench_common.write_json(path, result)
    from results_table import startup_table

    print('\n'.join(startup_table(result)))


def _by_m(rows, kind, run, num_layers, k, schedule, beside=None):
    """{M: row} of one kind and run at (L, K), of `schedule` unless None; plain steps of the
    process that measured `beside` (files written before each schedule had a process of its
    own have one plain step per (K, L, M), for every schedule)."""
    return {
        r['num_micro_batches']: r
        for r in rows
        if r['kind'] == kind
        and r.get('run', 0) == run
        and (r['layers'], r['num_stages']) == (num_layers, k)
        and (schedule is None or r['schedule'] == schedule)
        and r.get('beside') in (None, beside)
    }


def _median(values):
    return float(statistics.median(values))


def main(argv):
    del argv
    if CHILD.value:
        return _child(CHILD.value)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_common
    import grappler_log

    if SUMMARISE.value:
        return _summarise_file(SUMMARISE.value, bench_common)

    rows = []
    for k in STAGES.value:
        for num_layers in LAYERS.value:
            if int(k) > int(num_layers):
                continue
            # Each schedule in a process of its own, beside a plain step of its own: in one
            # process, a schedule measured after others ran slower (their graphs and memory
            # stay), e.g. 1F1B at K=4, L=64, M=32 after gpipe 50 s against 34 s alone.
            todo = [
                (run, m, schedule)
                for run in range(REPEATS.value)
                for m in MICRO.value
                for schedule in _schedules()
                if _runs(schedule, int(k), int(num_layers), int(m))
            ]
            for run, m, schedule in todo:
                cmd = [
                    sys.executable,
                    os.path.abspath(__file__),
                    f'--child={k},{num_layers},{m}',
                    f'--schedules={schedule}',
                    f'--recompute={POLICY.value}',
                    f'--tick_loop={TICK_LOOP.value}',
                    f'--step_grappler={STEP_GRAPPLER.value}',
                    *bench_common.given(TWINS, CELL_GRAPPLER),
                    f'--compare_unrolled={COMPARE.value}',
                    f'--steps={STEPS.value}',
                    f'--batch_size={BATCH.value}',
                    f'--dim={DIM.value}',
                    f'--measure={MEASURE.value}',
                    f'--workers={WORKERS.value}',
                ]
                env = dict(os.environ, **(grappler_log.ENV if GRAPPLER_PASSES.value else {}))
                done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
                if done.returncode:
                    sys.exit(f'K={k} L={num_layers} M={m} failed:\n{done.stderr[-3000:]}')
                got = json.loads(done.stdout.strip().splitlines()[-1])
                if GRAPPLER_PASSES.value:
                    _attach_grappler(got, grappler_log.parse(done.stderr))
                for r in got:
                    r['run'] = run
                    if r['kind'] == 'plain':
                        r['beside'] = schedule  # the plain step of this schedule's process
                rows += got
                for r in got:
                    print(
                        f'K={k} L={num_layers} M={m} run {run} {r["kind"]:8s} {r["schedule"]:16s} '
                        f'trace {r["trace_s"]:6.2f}s first {r["first_call_s"]:6.2f}s '
                        f'(CPU {r["trace_cpu_s"]:6.2f}s {r["first_call_cpu_s"]:6.2f}s; '
                        f'GC in trace {r["trace_gc_s"]:5.2f}s, {r["trace_full_gcs"]} full) '
                        f'steady {1e3 * r["steady_s"]:7.1f}ms nodes {r["outer_nodes"]} '
                        f'lib {r["library_nodes"]}',
                        flush=True,
                    )
                    if r.get('grappler'):
                        g = r['grappler']
                        top = sorted(g['passes'].items(), key=lambda kv: -kv[1])[:4]
                        print(
                            f'    Grappler {g["seconds"]:5.2f}s, nodes {g["nodes_before"]} -> '
                            f'{g["nodes_after"]}: '
                            + ', '.join(f'{name} {ms:.0f}ms' for name, ms in top),
                            flush=True,
                        )
    result = dict(
        bench_common.run_metadata(),
        startup=True,
        per_schedule=True,  # each schedule in a process of its own, beside its plain step
        engine=(f'{LABEL.value}: ' if LABEL.value else '')
        + (
            ('eval loop (eval_loop=True)' if TICK_LOOP.value else 'unrolled (eval_loop=False)')
            if MEASURE.value == 'eval'
            else 'tick loop (tick_loop=True)'
            if TICK_LOOP.value
            else 'unrolled (tick_loop=False)'
        )
        + (
            ''
            if STEP_GRAPPLER.value
            else ', Grappler off in the whole process (the plain step too)'
        ),
        model=(
            f'Transformer d={DIM.value}, {HEADS} heads, hidden {2 * DIM.value}, '
            f'batch {BATCH.value} x {SEQ}'
            + (', each stage on a single-core TF worker process' if WORKERS.value else '')
        ),
        recompute=POLICY.value,
        twin_cells=bench_common.library_default('twin_cells', TWINS.value),
        cell_grappler=bench_common.library_default('cell_grappler', CELL_GRAPPLER.value),
        measured=MEASURE.value,
        grappler_passes=GRAPPLER_PASSES.value,
        rows=rows,
        summary=summarise(rows),
    )
    from results_table import startup_grappler_table, startup_table

    print('\n'.join(startup_table(result)))
    if GRAPPLER_PASSES.value:
        print('\n'.join(startup_grappler_table([result])))
    if OUTPUT.value:
        bench_common.write_json(OUTPUT.value, result)


if __name__ == '__main__':
    app.run(main)
