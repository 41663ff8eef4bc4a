"""The README's markdown tables, printed from the JSON files the measuring tools wrote.

    python tools/results_table.py docs/results/peak_memory.json
    python tools/results_table.py docs/results/schedules.json
    python tools/results_table.py docs/results/timeline_*.json
    python tools/results_table.py docs/results/max_model_size_amoebanet.json

Nothing is typed by hand: each table is this script's output for files that
`make engine-results` (peak_memory.py, benchmark.py, timeline.py) wrote.
"""

import json
import sys


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
    if isinstance(first, list):
        return schedules_table(first)
    return timeline_table(loaded)


if __name__ == '__main__':
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print('\n'.join(table(sys.argv[1:])))
