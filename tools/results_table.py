"""The docs' markdown tables, printed from the JSON files the measuring tools wrote.

    python tools/results_table.py --write         # rewrite every results block of the README
                                                  # and docs/*.md (--readme: the old name)
    python tools/results_table.py --check         # exit 1 naming the blocks that are stale
    python tools/results_table.py docs/results/peak_memory.json
    python tools/results_table.py docs/results/schedules.json
    python tools/results_table.py docs/results/timeline_*.json
    python tools/results_table.py docs/results/max_model_size_amoebanet.json
    python tools/results_table.py docs/results/data_parallel.json

Nothing is typed by hand: each table is this script's output for files that
`make engine-results` (peak_memory.py, benchmark.py, timeline.py) wrote.
"""

import glob
import json
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
# A results block of a page: the table of the JSON files named in its opening marker.
BLOCK = re.compile(r'(<!-- results: (?P<files>[^>]+?) -->\n)(?P<body>.*?)(<!-- /results -->)', re.S)


def memory_table(result):
    lines = [
        f'{result["layers"]} FC x {result["width"]}, batch {result["batch_size"]}, K=1 '
        + ('(the tick loop) ' if result.get('tick_loop') else '')
        + ('(cells without Grappler) ' if result.get('cell_grappler') is False else '')
        + '(peak bytes above the resident weights):',
        '',
        '| setting | M | recompute | peak MiB | vs plain | high-water | units | predicted MiB |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for r in result['rows']:
        hw = '' if r.get('high_water') is None else f'{r["high_water"]:g}'
        units = '' if r.get('activation_units') is None else f'{r["activation_units"]:g}'
        pred = f'{r["predicted_bytes"] / 2**20:.1f}' if 'predicted_bytes' in r else ''
        lines.append(
            f'| {r["setting"]} | {r["num_micro_batches"]} | {r["recompute"]} | '
            f'{r["peak_bytes"] / 2**20:.1f} | {r["ratio_to_plain"]:.2f} | {hw} | {units} | '
            f'{pred} |'
        )
    return lines


# How a table of rounds with and without Grappler on the cells names its commands.
AB_NOTE = ', with `--nocell_grappler` or `--cell_grappler`'


def _ab_command(results):
    """The command of rounds that differ only in --[no]cell_grappler and --output, once."""
    drop = ('--output=', '--cell_grappler', '--nocell_grappler')
    commands = sorted(
        {
            shlex.join(w for w in shlex.split(r['command']) if not w.startswith(drop))
            for r in results
            if r.get('command')
        }
    )
    return '; '.join(f'`{c}`' for c in commands) + AB_NOTE


def _grappler_rounds(results):
    """(rounds without, rounds with Grappler on the cells, how they were written) of files
    that say `cell_grappler`."""
    off = [r for r in results if r.get('cell_grappler') is False]
    on = [r for r in results if r.get('cell_grappler') is not False]
    return off, on, _written(results, _ab_command(results))


def _written(results, commands):
    """When, where and how files of rounds were measured: 'written <first date> to <last> on
    <machine>, TF <version> (<commands>)'."""
    first = results[0]
    return (
        f'written {min(r.get("date", "") for r in results)} to '
        f'{max(r.get("date", "") for r in results)} on {first.get("machine", "")}, TF '
        f'{first.get("tf_version", "")} ({commands})'
    )


def _commands(results):
    """Each file's command, quoted as code, in order."""
    return '; '.join(f'`{r["command"]}`' for r in results if r.get('command'))


def _median_span(values):
    """median, least, most."""
    import statistics

    return statistics.median(values), min(values), max(values)


def _median_range(values, fmt):
    """'median [least–most]' of `values`, each in format `fmt`."""
    median, least, most = _median_span(values)
    return f'{median:{fmt}} [{least:{fmt}}–{most:{fmt}}]'


def memory_grappler_table(results):
    """Rounds of tools/peak_memory.py with and without Grappler on the cells: per row, the
    median [least–most] of each, and the ratio of the medians."""
    off, on, written = _grappler_rounds(results)
    first = results[0]
    lines = [
        f'{first["layers"]} FC x {first["width"]}, batch {first["batch_size"]}, K=1, peak MiB '
        f'above the resident weights: {len(off)} rounds with the cells as traced (the default) '
        f'and {len(on)} with Grappler on the cells, alternating, {written}:',
        '',
        '| setting | M | recompute | without Grappler: median | [min–max] | with: median '
        '| [min–max] | without / with |',
        '|---|---|---|---|---|---|---|---|',
    ]

    for i, row in enumerate(first['rows']):
        a, b = (
            _median_span([r['rows'][i]['peak_bytes'] / 2**20 for r in runs]) for runs in (off, on)
        )
        lines.append(
            f'| {row["setting"]} | {row["num_micro_batches"]} | {row["recompute"]} | '
            f'{a[0]:.1f} | [{a[1]:.1f}–{a[2]:.1f}] | {b[0]:.1f} | [{b[1]:.1f}–{b[2]:.1f}] | '
            f'{a[0] / b[0]:.2f} |'
        )
    return lines


def schedules_table(results):
    lines = []
    # Several benchmark runs (e.g. two versions in turn): each run's tables under its command.
    several = len({res.get('command') for res in results}) > 1
    command = None
    for res in results:
        if several and res.get('command') != command:
            command = res.get('command')
            lines += [
                f'Written {res.get("date", "")} on {res.get("machine", "")}, TF '
                f'{res.get("tf_version", "")} (`{command}`):',
                '',
            ]
        runs = max(r['runs'] for r in res['throughput'])
        lines += [
            f'{res["family"]} (knob {res["knob"]}, {res["config"]}, batch {res["batch_size"]}), '
            f'recompute={res["recompute"]}'
            + {True: ', Grappler on the cells', False: ', cells without Grappler'}.get(
                res.get('cell_grappler'), ''
            )
            + '; examples/s, and the speed-up over the K=1 row of '
            f'the same M measured in the same process: median of {runs} fresh processes '
            '[min–max]:',
            '',
            '| schedule | K | M | examples/s | speed-up | [min–max] | ideal bound | efficiency |',
            '|---|---|---|---|---|---|---|---|',
        ]
        order = {name: i for i, name in enumerate(res['schedules'])}
        rows = sorted(
            res['throughput'],
            # The K=1 row runs fill-drain, which --schedules need not name.
            key=lambda r: (r['num_micro_batches'], r['num_stages'], order.get(r['schedule'], -1)),
        )
        for r in rows:
            head = (
                f'| {r["schedule"]} | {r["num_stages"]} | {r["num_micro_batches"]} | '
                f'{r["examples_per_s"]:.0f} |'
            )
            if r['num_stages'] == 1:
                lines.append(head + ' | | | |')
                continue
            lo, hi = r['speedup_spread']
            lines.append(
                f'{head} {r["speedup"]:.2f} | {lo:.2f}–{hi:.2f} | {r["bubble_bound"]:.2f} | '
                f'{r["efficiency"]:.2f} |'
            )
        lines.append('')
    return lines


def data_parallel_table(results):
    """benchmark.py --data_parallel: R=2 x K=1 (MultiWorkerMirroredStrategy) beside R=1 x K=1
    and the pipeline's R=1 x K=2, per M."""
    lines = []
    for res in results:
        dp = res['data_parallel']
        lines += [
            f'{res["family"]} (knob {res["knob"]}, {res["config"]}, global batch '
            f'{res["batch_size"]}), recompute={res["recompute"]}; examples/s and speed-ups, '
            f'median of {dp[0]["runs"]} runs [min–max]. Data: two single-core processes '
            'under MultiWorkerMirroredStrategy over one such process; pipeline: a client '
            'driving two single-core workers over K=1 on one of them (each ratio within a run):',
            '',
            '| M | R=1 x K=1 | R=2 x K=1 (data) | speed-up | [min–max] | R=1 x K=2 (pipeline) '
            '| speed-up | [min–max] |',
            '|---|---|---|---|---|---|---|---|',
        ]
        pipe = {
            r['num_micro_batches']: r
            for r in res['throughput']
            if r['num_stages'] == 2 and r['schedule'] == res['schedules'][0]
        }
        for r in dp:
            lo, hi = r['speedup_r2_spread']
            p = pipe.get(r['num_micro_batches'])
            tail = (
                f'{p["examples_per_s"]:.0f} | {p["speedup"]:.2f} | '
                f'{p["speedup_spread"][0]:.2f}–{p["speedup_spread"][1]:.2f} |'
                if p
                else '- | - | - |'
            )
            lines.append(
                f'| {r["num_micro_batches"]} | {r["examples_per_s_r1"]:.0f} | '
                f'{r["examples_per_s_r2"]:.0f} | {r["speedup_r2"]:.2f} | {lo:.2f}–{hi:.2f} | '
                + tail
            )
        lines.append('')
    return lines


def overheads_table(results):
    """benchmark.py --overheads: step time on one worker over the plain layer sequence's."""
    names = [r['name'] for r in results[0]['overheads'][1:]]
    lines = [
        '| model | plain step s | ' + ' | '.join(names) + ' |',
        '|---' * (len(names) + 2) + '|',
    ]
    for res in results:
        plain, *rest = res['overheads']
        lines.append(
            f'| {res["family"]} (knob {res["knob"]}, batch {res["batch_size"]}) | '
            f'{plain["seconds"]:.3f} | ' + ' | '.join(f'{r["vs_plain"]:.2f}' for r in rest) + ' |'
        )
    return lines


def timeline_table(results):
    lines = [
        '| schedule | K | M | recompute | step ms | F / B / W ms | bubble measured | ideal |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for r in results:
        lines.append(
            f'| {r["schedule"]} | {r["num_stages"]} | {r["num_micro_batches"]} | '
            f'{r["recompute"]} | {r["step_ms"]:.0f} | {r["forward_ms"]:.1f} / '
            f'{r["backward_ms"]:.1f} / {r["weight_ms"]:.1f} | {r["bubble_measured"]:.3f} | '
            f'{r["bubble_ideal"]:.3f} |'
        )
    return lines


def max_size_table(result):
    """Table 1: the largest model per setting in one budget (tools/max_model_size.py)."""
    knob = result['knob']
    lines = [
        f'{result["family"]} {result["config"]}, batch {result["batch_size"]}, '
        f'M={result["num_micro_batches"]}, Adam, {result["budget_mb"]} MB per device '
        f'({result.get("date", "")}; `{result.get("command", "")}`):',
        '',
        f'| setting | {knob} | params | x naive | weights+Adam MiB | peak step MiB |',
        '|---|---|---|---|---|---|',
    ]
    base = result['rows'][0].get('params')
    for r in result['rows']:
        ratio = f'{r["params"] / base:.2f}' if base and r.get('params') else '-'
        peak = r.get('peak_step_bytes')
        lines.append(
            f'| {r["setting"]} | {r["knob"]} | {r.get("params", 0):,} | {ratio} | '
            f'{r.get("param_bytes", 0) / 2**20:.1f} | '
            f'{"-" if peak is None else f"{peak / 2**20:.1f}"} |'
        )
    return lines


def plans_table(result):
    """tools/plan.py --output: the ranked plans of one model on N devices of a profile."""
    d = result['device']
    lines = [
        f'{result["model"]}: input {tuple(result["input_shape"])}, {result["num_devices"]} x '
        f'{d["name"]} ({d["memory_bytes"] / 2**30:.0f} GiB, {d["flops_per_second"] / 1e12:.1f} '
        f'TFLOP/s effective) (`{result.get("command", "")}`):',
        '',
        '| M | schedule | recompute | peak GiB | step s | examples/s | bubble | fits |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for p in result['plans']:
        lines.append(
            f'| {p["num_micro_batches"]} | {p["schedule"]} | {p["recompute"]} | '
            f'{p["peak_bytes"] / 2**30:.2f} | {p["step_seconds"]:.3f} | '
            f'{p["examples_per_second"]:.1f} | {p["bubble"]:.3f} | '
            f'{"yes" if p["fits"] else "no"} |'
        )
    return lines


def _ratio(measured, predicted):
    return measured / predicted if predicted else float('nan')


def plan_check_table(result):
    """Markdown lines: each configuration's predicted and measured peak (per device) and step."""
    link = result.get('link')
    lines = [
        f'Measured {result.get("date", "")} on {result.get("machine", "")}, TF '
        f'{result.get("tf_version", "")} (`{result.get("command", "")}`)'
        + (
            f'; loopback link {link["link_bytes_per_second"] / 1e9:.2f} GB/s, latency '
            f'{link["link_latency_seconds"] * 1e3:.2f} ms'
            if link
            else ''
        )
        + ('; Grappler on the cells' if result.get('cell_grappler') else '')
        + ':',
        '',
        '| model | K | M | schedule | recompute | device | peak MiB predicted | measured | '
        'measured / predicted | step s predicted | measured | measured / predicted |',
        '|---|---|---|---|---|---|---|---|---|---|---|---|',
    ]
    for r in result['rows']:
        family, knob, batch, k, m, schedule, recompute = r['config'].split(':')
        pred = r['predicted']
        for d, measured in enumerate(r['measured_peak_bytes']):
            time_cells = '| | |'
            if d == 0 and r.get('measured_step_seconds'):
                t_pred, t_meas = pred['step_seconds'], r['measured_step_seconds']
                time_cells = f'{t_pred:.3f} | {t_meas:.3f} | {_ratio(t_meas, t_pred):.2f} |'
            head = (
                f'| {family} {knob}, batch {batch} | {k} | {m} | {schedule} | {recompute} '
                if d == 0
                else '| | | | | '
            )
            lines.append(
                f'{head}| {d} | {pred["peak_bytes"][d] / 2**20:.1f} | {measured / 2**20:.1f} | '
                f'{_ratio(measured, pred["peak_bytes"][d]):.2f} | {time_cells}'
            )
    return lines + ['', _plan_check_summary(result)]


def _plan_check_summary(result):
    """The table against the planner's targets (memory within 15%, step time within 20%),
    counted from its rows."""
    memory = [
        abs(_ratio(m, p) - 1)
        for r in result['rows']
        for m, p in zip(r['measured_peak_bytes'], r['predicted']['peak_bytes'])
    ]
    steps = [
        abs(_ratio(r['measured_step_seconds'], r['predicted']['step_seconds']) - 1)
        for r in result['rows']
        if r.get('measured_step_seconds')
    ]
    text = (
        f'Against the targets (computed from the rows above): memory within 15% in '
        f'{sum(e <= 0.15 for e in memory)} of {len(memory)} device peaks '
        f'({sum(e <= 0.10 for e in memory)} within 10%)'
    )
    if steps:
        text += f'; step time within 20% in {sum(e <= 0.20 for e in steps)} of {len(steps)} rows'
    return text + '.'


def plan_check_rounds_table(results):
    """Rounds of `plan_check.py --local` without and with Grappler on the cells: per
    configuration, the predicted peak and each setting's measured median [least–most]."""
    off, on, written = _grappler_rounds(results)
    first = results[0]
    lines = [
        f'{len(off)} rounds without Grappler on the cells (the default) and {len(on)} with, '
        f'alternating, each a fresh process per configuration whose peak is the highest of its '
        f'steps; {written}:',
        '',
        '| model | K | M | schedule | recompute | peak MiB predicted | without Grappler: '
        'median | [min–max] | / predicted | with: median | [min–max] | / predicted |',
        '|---|---|---|---|---|---|---|---|---|---|---|---|',
    ]
    for i, row in enumerate(first['rows']):
        family, knob, batch, k, m, schedule, recompute = row['config'].split(':')
        predicted = row['predicted']['peak_bytes'][0] / 2**20
        cells = []
        for runs in (off, on):
            median, least, most = _median_span(
                [r['rows'][i]['measured_peak_bytes'][0] / 2**20 for r in runs]
            )
            cells.append(f'{median:.1f} | [{least:.1f}–{most:.1f}] | {median / predicted:.2f}')
        lines.append(
            f'| {family} {knob}, batch {batch} | {k} | {m} | {schedule} | {recompute} | '
            f'{predicted:.1f} | {cells[0]} | {cells[1]} |'
        )
    return lines


def paper_scale_tables(result):
    """Markdown lines of both tables."""
    lines = [
        '| model | setting | planned size | params | peak GiB | paper size | paper params | '
        'planned / paper |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for r in result['table1']:
        peak = f'{r["peak_bytes"] / (1 << 30):.2f}' if r['peak_bytes'] else '–'
        lines.append(
            f'| {r["model"]} ({r["device"]}) | {r["setting"]} | {r["size"]} | '
            f'{_count(r["params"]) if r["params"] else "–"} | {peak} | {r["paper_size"]} | '
            f'{_count(r["paper_params"])} | '
            f'{r["params"] / r["paper_params"]:.2f} |'
        )
    lines += [
        '',
        '| model (TPU v3) | K | M=1 | M=4 | M=32 | paper M=1 | M=4 | M=32 |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for r in result['table2']:
        planned = ' | '.join(
            f'{s:.2f}' + ('' if fits else ' (no fit)') for s, fits in zip(r['speedup'], r['fits'])
        )
        paper = ' | '.join(f'{s:.2f}' for s in r['paper'])
        lines.append(f'| {r["model"]} | {r["num_devices"]} | {planned} | {paper} |')
    return lines


def _count(n):
    return f'{n / 1e9:.2f}B' if n >= 1e9 else f'{n / 1e6:.1f}M'


def fault_drill_table(r):
    """tools/fault_drill.py --output: kill -9 at random steps, restarts, what was lost."""
    deviation = r['max_weight_deviation']
    kills = ', '.join(str(k['kill_at']) for k in r['kill_log'])
    resumed = ', '.join(str(k['last_checkpoint']) for k in r['kill_log'])
    return [
        f'{r["model"]}, {r["max_steps"]} steps, a checkpoint every {r["save_interval_steps"]} '
        f'({r.get("date", "")}; `{r.get("command", "")}`, {r["seconds"]:.0f} s):',
        '',
        '| runs | kills | steps redone | checkpoints lost | final-weight deviation |',
        '|---|---|---|---|---|',
        f'| {r["runs"]} | {r["kills"]} | {r["steps_redone"]} | {r["checkpoints_lost"]} | '
        f'{deviation:.2g}{" (bitwise equal)" if deviation == 0 else ""} |',
        '',
        f'Killed at steps {kills}; resumed from checkpoints {resumed}.',
    ]


def table(paths):
    """The markdown lines of `paths`, led by where and how they were measured when the files
    say so and the table does not already."""
    lines = _table(paths)
    metas = []
    for path in paths:
        loaded = json.load(open(path))
        meta = loaded[0] if isinstance(loaded, list) and loaded else loaded
        if isinstance(meta, dict) and meta.get('command'):
            metas.append(meta)
    text = '\n'.join(lines)
    # A table that already says when it was measured (the two-version and Grappler tables,
    # whose commands differ by a flag) says where and how too.
    if not metas or metas[0]['command'] in text or any(m.get('date', '\0') in text for m in metas):
        return lines
    first = metas[0]
    if len(metas) == 1 or not first.get('startup'):  # one file's table says one command
        commands, dates = f'`{first["command"]}`', first.get('date', '')
    else:  # tools/startup.py files merged into one table: each run's command
        commands = '; '.join(f'`{m["command"]}`' for m in metas)
        dates = f'{metas[0].get("date", "")} to {metas[-1].get("date", "")}'
    return [
        f'Written {dates} on {first.get("machine", "")}, TF '
        f'{first.get("tf_version", "")} ({commands}):',
        '',
    ] + lines


def startup_ab_table(results):
    """Rounds of tools/startup.py of two versions (files whose `engine` labels differ), run
    alternately: per (L, K, M), schedule and executor, each version's trace, first call,
    start-up and steady step, the median [least–most] over its rounds, the start-up over the
    plain step's of the same process (median over the rounds), and the start-up's ratio of
    the medians."""
    labels = list(dict.fromkeys(r['engine'] for r in results))
    first = results[0]
    # Files that recorded the trace's garbage collections (trace_gc_s) get two more columns.
    with_gc = all('trace_gc_s' in r for result in results for r in result['rows'])
    gc_head = (
        "| of the trace, in GC s (full ones) | the plain step's, in GC s (full ones) "
        if with_gc
        else ''
    )
    lines = [
        f'{first["model"]}, recompute={first["recompute"]}; rounds of each version in turn, '
        f'each (K, L, M) in a fresh process: the median [least–most] over the rounds; '
        f'{_written(results, _commands(results))}:',
        '',
        '| version | L | K | M | schedule | rounds | trace s | first call s | start-up s '
        "| steady ms | start-up / plain's | nodes: outer + library | start-up / the first "
        f"version's {gc_head}|",
        '|---|---|---|---|---|---|---|---|---|---|---|---|---|' + '---|' * (2 if with_gc else 0),
    ]
    groups = {}  # (L, K, M, schedule, kind) -> {label: [(row, its process's plain row)]}
    for result in results:
        plain = None
        for r in result['rows']:
            if r['kind'] == 'plain':  # each process measures the plain step first
                plain = r
                continue
            key = (r['layers'], r['num_stages'], r['num_micro_batches'], r['schedule'], r['kind'])
            groups.setdefault(key, {}).setdefault(result['engine'], []).append((r, plain))

    def cell(values, scale=1.0, fmt='.1f'):
        scaled = [v * scale for v in values]
        return _median_range(scaled, fmt), _median_span(scaled)[0]

    kinds = {k[-1] for k in groups}
    for key in sorted(groups):
        base = None
        for label in labels:
            pairs = groups[key].get(label, [])
            rows = [r for r, _ in pairs]
            trace, _ = cell([r['trace_s'] for r in rows])
            first_call, _ = cell([r['first_call_s'] for r in rows])
            startup, median = cell([r['startup_s'] for r in rows])
            steady, _ = cell([r['steady_s'] for r in rows], 1e3, '.0f')
            ratios = [r['startup_s'] / p['startup_s'] for r, p in pairs if p is not None]
            vs_plain = cell(ratios, fmt='.2f')[0] if ratios else ''
            base = median if base is None else base
            # Two kinds only with --compare_unrolled, which runs the tick loop beside.
            kind = {'pipeline': 'tick loop'}.get(key[4], key[4])
            schedule = key[3] if len(kinds) == 1 else f'{key[3]} ({kind})'
            # A graph's size is the same in every round: the first round's.
            nodes = f'{rows[0]["outer_nodes"]} + {rows[0]["library_nodes"]}' if rows else ''
            # Both executors in one process: the label's executor (the file's) names neither.
            shown = label.rsplit(': ', 1)[0] if len(kinds) > 1 else label
            gc_cells = ''
            if with_gc:
                plains = [p for _, p in pairs if p is not None]
                gc_cells = f' {_collections(rows)} | {_collections(plains)} |'
            lines.append(
                f'| {shown} | {key[0]} | {key[1]} | {key[2]} | {schedule} | {len(rows)} '
                f'| {trace} | {first_call} | {startup} | {steady} | {vs_plain} | {nodes} '
                f'| {median / base:.2f} |{gc_cells}'
            )
    return lines


def _collections(rows):
    """The seconds of the rows' traces spent in Python's garbage collections, median
    [least–most], and how many full collections each trace ran (one number when all ran as
    many)."""
    if not rows:
        return ''
    full = sorted({r['trace_full_gcs'] for r in rows})
    counts = str(full[0]) if len(full) == 1 else f'{full[0]}–{full[-1]}'
    return f'{_median_range([r["trace_gc_s"] for r in rows], ".2f")} ({counts})'


# Grappler's passes a table names apart; the others are summed in one column.
_GRAPPLER_COLUMNS = 6


def startup_grappler_table(results):
    """tools/startup.py --grappler_passes: per (L, K, M) and step, what Grappler did at its
    first call (TF's log, tools/grappler_log.py): its seconds and each pass's milliseconds, the
    median [least–most] over the rounds, and the graph's nodes before and after."""
    first = results[0]
    groups = {}  # (L, K, M, step) -> [row's Grappler record]
    for result in results:
        for r in result['rows']:
            if not r.get('grappler'):
                continue
            step = f'plain (beside {r["beside"]})' if r['kind'] == 'plain' else r['schedule']
            key = (r['layers'], r['num_stages'], r['num_micro_batches'], step)
            groups.setdefault(key, []).append(r['grappler'])
    totals = {}
    for records in groups.values():
        for g in records:
            for name, ms in g['passes'].items():
                totals[name] = totals.get(name, 0.0) + ms
    named = sorted(totals, key=lambda n: -totals[n])[:_GRAPPLER_COLUMNS]
    lines = [
        f"{first['model']}, recompute={first['recompute']}: what Grappler did at each step's "
        "first call, from TF's log (`meta_optimizer.cc` at verbosity 1), each pass's time "
        'summed over its rounds; the median [least–most] over the runs; '
        f'{_written(results, _commands(results))}:',
        '',
        '| step | L | K | M | runs | nodes before → after | Grappler s | '
        + ' | '.join(f'{n} ms' for n in named)
        + ' | other passes ms |',
        '|---|---|---|---|---|---|---|' + '---|' * (len(named) + 1),
    ]

    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2], not k[3].startswith('plain'), k[3])):
        records = groups[key]
        nodes = f'{records[0]["nodes_before"]} → {records[0]["nodes_after"]}'
        passes = [_median_range([g['passes'].get(n, 0.0) for g in records], '.0f') for n in named]
        other = _median_range(
            [sum(ms for n, ms in g['passes'].items() if n not in named) for g in records], '.0f'
        )
        lines.append(
            f'| {key[3]} | {key[0]} | {key[1]} | {key[2]} | {len(records)} | {nodes} | '
            f'{_median_range([g["seconds"] for g in records], ".2f")} | '
            + ' | '.join(passes)
            + f' | {other} |'
        )
    return lines


def startup_table(result):
    """tools/startup.py: start-up (trace + first call) per M against the plain sequence's."""
    summary = result['summary']
    ms = sorted({int(m) for s in summary for m in s['startup_s']})
    engine = f'{result["engine"]}: ' if result.get('engine') else ''
    compared = any('unrolled_steady_ms' in s for s in summary)
    ratio = any('steady_ratio' in s for s in summary)
    net = any('growth_net_of_step' in s for s in summary)
    runs = max(s.get('runs', 1) for s in summary)
    each = (
        'each (K, L, M) and schedule in a fresh process, the plain step measured there too'
        if result.get('per_schedule')
        else 'each (K, L, M) in a fresh process'
    )
    how = (
        f', {each}, one run:'
        if runs == 1
        else f', {each}, {runs} times, round after round over M: the median (range) of each '
        "start-up, and the median of each round's ratios:"
    )
    lines = [
        f'{engine}{result["model"]}, recompute={result["recompute"]}'
        + (f', twin_cells={result["twin_cells"]}' if 'twin_cells' in result else '')
        + (f', cell_grappler={result["cell_grappler"]}' if 'cell_grappler' in result else '')
        + '; start-up = trace + first call of '
        + {
            'eval': "eval's forward (FProp in eval mode)",
            'fprop': "a training step by gpipe's FProp under a tape (loss and gradients)",
        }.get(result.get('measured'), 'a training step (loss and gradients)')
        + how,
        '',
        '| L | K | schedule | '
        + ' | '.join(f'start-up s, M={m}' for m in ms)
        + ' | M=max / M=min |'
        + (' the same, less one steady step each |' if net else '')
        + ' vs plain at M=max | plain s | nodes per extra micro-batch '
        '| steady ms (plain) |'
        + (' unrolled at M=max: start-up s | steady ms |' if compared else '')
        + (' steady loop / unrolled, per round: median (range) |' if ratio else ''),
        '|---|---|---|'
        + '---|' * len(ms)
        + '---|' * (1 + net)
        + '---|---|---|---|'
        + '---|---|' * compared
        + '---|' * ratio,
    ]

    def cell(s, m):
        if str(m) not in s['startup_s']:
            return ''
        value = f'{s["startup_s"][str(m)]:.1f}'
        if 'startup_range' in s:
            low, high = s['startup_range'][str(m)]
            value += f' ({low:.1f}–{high:.1f})'
        return value

    for s in summary:
        cells = ' | '.join(cell(s, m) for m in ms)
        per_mb = '' if s['nodes_per_micro_batch'] is None else f'{s["nodes_per_micro_batch"]:.0f}'
        growth = f'{s["growth"]:.2f} |'
        if net:
            growth += f' {s["growth_net_of_step"]:.2f} |' if 'growth_net_of_step' in s else ' |'
        lines.append(
            f'| {s["layers"]} | {s["num_stages"]} | {s["schedule"]} | {cells} | {growth} '
            f'{s["vs_plain"]:.2f} | {s["plain_startup_s"]:.1f} | {per_mb} | '
            f'{s["steady_ms"]:.0f} ({s["plain_steady_ms"]:.0f}) |'
            + (
                f' {s["unrolled_startup_s"]:.1f} | {s["unrolled_steady_ms"]:.0f} |'
                if 'unrolled_steady_ms' in s
                else ' | |' * compared
            )
            + (
                f' {s["steady_ratio"]:.2f} ({s["steady_ratio_range"][0]:.2f}–'
                f'{s["steady_ratio_range"][1]:.2f}) |'
                if 'steady_ratio' in s
                else ' |' * ratio
            )
        )
    return lines + startup_goals(summary)


def startup_goals(summary):
    """Engine v3's start-up goals (issue 26) read off a training table that has M=4 and M=32:
    growth from M=4 to M=32 at most 1.3, at most 2x the plain sequence's at K=4 and M=32, and
    no node per extra micro-batch whatever L; against the unrolled executor where measured."""
    rows = [s for s in summary if s['smallest_m'] == 4 and s['largest_m'] == 32]
    if not rows or any(s['schedule'] in ('eval', 'fprop') for s in summary):
        return []

    def span(values):
        low, high = f'{min(values):.2f}', f'{max(values):.2f}'
        return low if low == high else f'{low}–{high}'

    def flat(key, what):
        """How many rows grow by at most 1.3 from M=4 to M=32 by `key`, and the largest."""
        worst = max(rows, key=lambda s: s[key])
        return (
            f'{what} at most 1.3 in {sum(s[key] <= 1.3 for s in rows)} of {len(rows)} rows '
            f'(the largest {worst[key]:.2f}: L={worst["layers"]}, K={worst["num_stages"]}, '
            f'{worst["schedule"]})'
        )

    parts = [flat('growth', 'start-up at M=32 over M=4')]
    if all('growth_vs_plain' in s for s in rows):
        # Each start-up over the plain step of its own process: the host's drift between
        # processes taken out.
        parts.append(
            flat('growth_vs_plain', "the same, each over the plain step's start-up in its process,")
        )
    k4 = [s for s in rows if s['num_stages'] == 4]
    if k4:
        within = sum(s['vs_plain'] <= 2 for s in k4)
        parts.append(
            f'at K=4 and M=32, {span([s["vs_plain"] for s in k4])} times the plain '
            f"sequence's start-up (at most 2 in {within} of {len(k4)} rows)"
        )
    nodes = sorted({s['nodes_per_micro_batch'] for s in rows})
    layers = sorted({s['layers'] for s in rows})
    parts.append(
        'nodes per extra micro-batch '
        + (f'0 in every row (L = {", ".join(map(str, layers))})' if nodes == [0] else
           f'{", ".join(f"{n:.0f}" for n in nodes)}')
    )  # fmt: skip
    unrolled = [s for s in rows if 'unrolled_startup_s' in s]
    if unrolled:
        parts.append(
            'start-up at M=32 '
            + span([s['startup_s']['32'] / s['unrolled_startup_s'] for s in unrolled])
            + " times the unrolled executor's"
        )
    return [
        '',
        "Against engine v3's goals (computed from the rows above): " + '; '.join(parts) + '.',
    ]


def demos_table(result):
    lines = [
        '| model | K | M | schedule | steps | loss: first step, last | eval accuracy | BLEU | '
        'first step s | first step s, fresh processes | steps/s after it (evals, checkpoints '
        'in) | examples/s | wall s | decoding tokens/s: attention caches, recomputing the '
        'prefix |',
        '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|',
    ]
    for r in result['demos']:
        bleu = f'{r["bleu"]:.1f}' if 'bleu' in r else ''
        speed = r.get('decode_tokens_per_sec')
        decode = (
            ', '.join(
                f'{s["median"]:.0f} ({s["min"]:.0f}–{s["max"]:.0f})'
                for s in (speed['incremental'], speed['recompute'])
            )
            if speed
            else ''
        )
        fresh = r.get('first_step_fresh_s')
        fresh = f'{fresh["median"]:.1f} ({fresh["min"]:.1f}–{fresh["max"]:.1f})' if fresh else ''
        lines.append(
            f'| {r["model"]} | {r["num_partitions"]} | {r["num_micro_batches"]} | '
            f'{r["schedule"]} | {r["steps"]} | {r["first_loss"]:.2f}, {r["last_loss"]:.3f} | '
            f'{r["eval_accuracy"]:.3f} | {bleu} | {r["first_step_s"]:.1f} | {fresh} | '
            f'{r["steps_per_sec"]:.1f} | {r["examples_per_sec"]:.0f} | {r["wall_s"]:.0f} | '
            f'{decode} |'
        )
    runs = result['demos'][0].get('decode_tokens_per_sec', {}).get('runs')
    lines += ['', f'{result["machine"]}, TF {result["tf_version"]}, {result["date"]}: '
              f'`{result["command"]}` (one training run; decoding: the median (least–most) of '
              f'{runs} runs of the first test batch after a warm-up: beam search of 4 for '
              f'translation, sampling for the language model).']  # fmt: skip
    fresh = result['demos'][0].get('first_step_fresh_s')
    if fresh:
        lines[-1] += (
            ' "First step s" is the training run\'s, in a process that had run the other demo '
            'first for the second row; "fresh processes" is the median (least–most) of '
            f'{fresh["runs"]} new trainer processes training one step each, as `make demo` '
            'starts.'
        )
    return lines


def _table(paths):
    loaded = [json.load(open(p)) for p in paths]
    first = loaded[0]
    if isinstance(first, dict) and 'demos' in first:
        return demos_table(first)
    if isinstance(first, dict) and first.get('startup'):
        if first.get('grappler_passes'):
            return startup_grappler_table(loaded)
        if len({r['engine'] for r in loaded}) > 1:  # two versions, rounds in turn
            return startup_ab_table(loaded)
        # Several runs of one grid (e.g. one per L): one table over their summaries.
        return startup_table(dict(first, summary=[s for r in loaded for s in r['summary']]))
    if isinstance(first, dict) and 'kill_log' in first:
        return fault_drill_table(first)
    if isinstance(first, dict) and 'table1' in first:
        return paper_scale_tables(first)
    if isinstance(first, dict) and 'plans' in first:
        return plans_table(first)
    if isinstance(first, dict) and 'rows' in first and 'config' in first['rows'][0]:
        if len(loaded) > 1:
            return plan_check_rounds_table(loaded)
        return plan_check_table(first)
    if isinstance(first, dict) and 'budget_mb' in first:
        return max_size_table(first)
    if isinstance(first, dict) and 'rows' in first and len(loaded) > 1:
        return memory_grappler_table(loaded)
    if isinstance(first, dict) and 'rows' in first:
        return memory_table(first)
    if isinstance(first, list):  # benchmark.py results: every file's families, in order
        results = [r for result in loaded for r in result]
        if results and results[0].get('data_parallel'):
            return data_parallel_table(results)
        if results and all(r.get('overheads') for r in results):
            return overheads_table(results)
        return schedules_table(results)
    return timeline_table(loaded)


def _files(spec):
    paths = [p for pattern in spec.split() for p in sorted(glob.glob(os.path.join(ROOT, pattern)))]
    if not paths:
        raise FileNotFoundError(f'A results block names {spec!r}: no such file.')
    return paths


def render(text):
    """`text` with every results block replaced by the table of its files."""

    def block(match):
        body = '\n'.join(table(_files(match['files']))).rstrip('\n') + '\n'
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(block, text)


def stale_blocks(text):
    """The file lists of the blocks whose text differs from their files' table."""
    fresh = {m['files']: m['body'] for m in BLOCK.finditer(render(text))}
    return [m['files'] for m in BLOCK.finditer(text) if fresh[m['files']] != m['body']]


def doc_files():
    """The pages that may hold results blocks: the README and the guides under docs/."""
    return [README] + sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))


def main(args):
    if not args:
        sys.exit(__doc__)
    if args[0] in ('--write', '--readme', '--check'):
        texts = {}
        for path in doc_files():
            with open(path, encoding='utf-8') as f:
                texts[path] = f.read()
        blocks = sum(len(BLOCK.findall(text)) for text in texts.values())
        if args[0] == '--check':
            stale = [
                f'{os.path.relpath(path, ROOT)}: {files}'
                for path, text in texts.items()
                for files in stale_blocks(text)
            ]
            if stale:
                sys.exit(f'Results blocks differ from their files: {", ".join(stale)}. '
                         'Run python tools/results_table.py --write.')  # fmt: skip
            print(f'{blocks} results blocks match their files.')
            return
        # Every page rendered before any is opened for writing: a missing file leaves all whole.
        rendered = {path: render(text) for path, text in texts.items()}
        for path, text in rendered.items():
            if text != texts[path]:
                with open(path, 'w', encoding='utf-8') as f:
                    f.write(text)
        print(f'{blocks} results blocks rewritten.')
        return
    print('\n'.join(table(args)))


if __name__ == '__main__':
    main(sys.argv[1:])
