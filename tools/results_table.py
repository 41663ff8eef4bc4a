"""The README's markdown tables, printed from the JSON files the measuring tools wrote.

    python tools/results_table.py --readme        # rewrite every results block of README.md
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
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
# A results block of the README: the table of the JSON files named in its opening marker.
BLOCK = re.compile(r'(<!-- results: (?P<files>[^>]+?) -->\n)(?P<body>.*?)(<!-- /results -->)', re.S)


def memory_table(result):
    lines = [
        f'{result["layers"]} FC x {result["width"]}, batch {result["batch_size"]}, K=1 '
        '(peak bytes above the resident weights):',
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


def schedules_table(results):
    lines = []
    for res in results:
        runs = max(r['runs'] for r in res['throughput'])
        lines += [
            f'{res["family"]} (knob {res["knob"]}, {res["config"]}, batch {res["batch_size"]}), '
            f'recompute={res["recompute"]}; examples/s, and the speed-up over the K=1 row of '
            f'the same M measured in the same process: median of {runs} fresh processes '
            '[min–max]:',
            '',
            '| schedule | K | M | examples/s | speed-up | [min–max] | ideal bound | efficiency |',
            '|---|---|---|---|---|---|---|---|',
        ]
        order = {name: i for i, name in enumerate(res['schedules'])}
        rows = sorted(
            res['throughput'],
            key=lambda r: (r['num_micro_batches'], r['num_stages'], order[r['schedule']]),
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


def table(paths):
    loaded = [json.load(open(p)) for p in paths]
    first = loaded[0]
    if isinstance(first, dict) and 'budget_mb' in first:
        return max_size_table(first)
    if isinstance(first, dict) and 'rows' in first:
        return memory_table(first)
    if isinstance(first, list):  # benchmark.py results: every file's families, in order
        results = [r for result in loaded for r in result]
        if results and results[0].get('data_parallel'):
            return data_parallel_table(results)
        return schedules_table(results)
    return timeline_table(loaded)


def _files(spec):
    paths = [p for pattern in spec.split() for p in sorted(glob.glob(os.path.join(ROOT, pattern)))]
    if not paths:
        raise FileNotFoundError(f'A README results block names {spec!r}: no such file.')
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


def main(args):
    if not args:
        sys.exit(__doc__)
    if args[0] in ('--readme', '--check'):
        with open(README, encoding='utf-8') as f:
            text = f.read()
        if args[0] == '--check':
            stale = stale_blocks(text)
            if stale:
                sys.exit(f'README results blocks differ from their files: {", ".join(stale)}. '
                         'Run python tools/results_table.py --readme.')  # fmt: skip
            print(f'{len(BLOCK.findall(text))} results blocks match their files.')
            return
        with open(README, 'w', encoding='utf-8') as f:
            f.write(render(text))
        print(f'{len(BLOCK.findall(text))} results blocks rewritten.')
        return
    print('\n'.join(table(args)))


if __name__ == '__main__':
    main(sys.argv[1:])
