"""The benchmark tools: their search and bubble arithmetic, and small real runs."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, 'tools')
sys.path.insert(0, TOOLS)

import bench_common  # noqa: E402


def _run(args, env=None, timeout=900):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', **(env or {}))
    proc = subprocess.run(
        [sys.executable] + args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize('limit', [1, 5, 6, 37, 300])
def test_largest_finds_the_last_knob_that_fits(limit):
    tried = []

    def trial(k):
        tried.append(k)
        return dict(ok=k <= limit, knob=k)

    best, result = bench_common.largest(trial, max_knob=256, log=lambda s: None)
    assert best == min(limit, 256) and result['knob'] == best
    assert len(tried) <= 2 * 9  # doubling then bisection, not a linear scan
    best, _ = bench_common.largest(trial, max_knob=256, start=4, log=lambda s: None)
    assert best == min(limit, 256)  # a start above the answer still bisects down to it


def test_ideal_timeline_has_each_schedules_bubble():
    from tf_gpipe.gpipe import schedules

    for k, m in [(2, 8), (4, 4), (3, 9)]:
        for name, v in [('gpipe', 1), ('1f1b', 1), ('interleaved_1f1b', 3)]:
            events = bench_common.ideal_events(schedules.build(name, k, m, v), 1.0, 2.0)
            span = max(e[4] for e in events)
            _, mean = bench_common.bubble(events, k, span)
            assert abs(mean - schedules.bubble_fraction(k, m, v)) < 1e-9


def test_a_trial_fits_or_runs_out_of_memory():
    args = [os.path.join(TOOLS, 'max_model_size.py'), '--trial=pipeline-1:1', '--batch_size=8']
    budget = dict(TF_CPU_ALLOCATOR_USE_BFC='true')
    fits = json.loads(_run(args, dict(budget, TF_CPU_BFC_MEM_LIMIT_IN_MB='256')).splitlines()[-1])
    assert fits['ok'] and fits['params'] > 0 and fits['peak_step_bytes'] > 0
    oom = json.loads(_run(args, dict(budget, TF_CPU_BFC_MEM_LIMIT_IN_MB='2')).splitlines()[-1])
    assert not oom['ok'] and oom['error'].startswith('OOM')


@pytest.mark.idle
def test_timeline_draws_a_real_step(tmp_path):
    png = str(tmp_path / 'step.png')
    out = _run(
        [
            os.path.join(TOOLS, 'timeline.py'),
            '--local',
            '--num_micro_batches=4',
            '--layers=4',
            '--width=256',
            '--batch_size=256',
            '--steps=2',
            f'--output={png}',
            '--json',
        ]
    )
    result = json.loads(out.splitlines()[-1])
    assert os.path.getsize(png) > 10_000
    assert result['bubble_ideal'] == pytest.approx(1 / 5)
    assert 0.0 <= result['bubble_measured'] < 1.0 and result['step_ms'] > 0


def test_benchmark_runs_on_two_workers():
    out = _run(
        [
            os.path.join(TOOLS, 'benchmark.py'),
            '--families=fc',
            '--knob=2',
            '--batch_size=64',
            '--micro_batches=2',
            '--schedules=gpipe,zero_bubble',
            '--overhead_micro_batches=2',
            '--steps=1',
            '--isolate=false',  # one client and one pair of workers for every row (suite time)
            '--data_parallel',
            '--json',
        ]
    )
    (result,) = json.loads(out.splitlines()[-1])
    # R=2 x K=1 under MultiWorkerMirroredStrategy beside R=1 x K=1 and the pipeline's K=2.
    (dp,) = result['data_parallel']
    assert dp['num_micro_batches'] == 2 and dp['runs'] == 1
    assert dp['examples_per_s_r1'] == pytest.approx(64 / dp['seconds_r1'])
    assert dp['speedup_r2'] == pytest.approx(dp['seconds_r1'] / dp['seconds_r2'])
    rows = {
        (r['schedule'], r['num_stages'], r['num_micro_batches']): r for r in result['throughput']
    }
    assert sorted(rows) == [('gpipe', 1, 2), ('gpipe', 2, 2), ('zero_bubble', 2, 2)]
    # Without M=1 (the paper's K=2, M=1 baseline) the smallest configuration is the baseline.
    assert rows[('gpipe', 1, 2)]['normalised'] == pytest.approx(1.0)
    assert rows[('gpipe', 2, 2)]['bubble_bound'] == pytest.approx(4 / 3)
    # zero_bubble, B = W = F: K=2, M=2 runs in 7 units against 6 units of work per stage.
    assert rows[('zero_bubble', 2, 2)]['bubble_bound'] == pytest.approx(2 * 6 / 7)
    assert rows[('zero_bubble', 2, 2)]['speedup'] > 0
    assert dp['pipeline_speedup_k2'] == rows[('gpipe', 2, 2)]['speedup']
    names = [r['name'] for r in result['overheads']]
    assert names[0] == 'plain sequence' and 'K=1 M=2 always' in names


def test_plan_ranks_configurations_and_names_a_bad_device(tmp_path):
    png, saved = tmp_path / 'plan.png', tmp_path / 'plan.json'
    out = _run(
        [
            os.path.join(TOOLS, 'plan.py'),
            '--model=lm.synthetic.TransformerLmTiny',
            '--device=v100-16gb',
            '--num_devices=2',
            '--micro_batches=1,2,4',
            '--json',
            f'--plot={png}',
            f'--output={saved}',
        ]
    )
    result = json.loads(out.splitlines()[-1])
    assert result == json.loads(saved.read_text())
    assert {'machine', 'tf_version', 'date', 'command'} <= set(result)
    plans = result['plans']
    assert {p['schedule'] for p in plans} >= {'gpipe', '1f1b'} and all(p['fits'] for p in plans)
    speeds = [p['examples_per_second'] for p in plans]
    assert speeds == sorted(speeds, reverse=True)
    assert all(len(p['stages']) == 2 and p['peak_bytes'] > 0 for p in plans)
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and png.stat().st_size > 10000
    # This machine: every layer timed here at each M's micro-batch size (token ids in).
    here = json.loads(
        _run(
            [
                os.path.join(TOOLS, 'plan.py'),
                '--model=lm.synthetic.TransformerLmTiny',
                '--device=this-machine',
                '--num_devices=1',
                '--micro_batches=1,2',
                '--json',
            ]
        ).splitlines()[-1]
    )
    assert here['device']['name'] == 'this-machine' and here['device']['memory_bytes'] > 1 << 30
    assert len(here['plans']) == 6 and all(p['step_seconds'] > 0 for p in here['plans'])
    bad = subprocess.run(
        [sys.executable, os.path.join(TOOLS, 'plan.py'), '--model=lm.synthetic.TransformerLmTiny',
         '--device=v100-16'], capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert bad.returncode != 0 and "did you mean 'v100-16gb'" in bad.stderr


def test_a_results_command_reruns_as_written(monkeypatch):
    """A flag value with spaces is quoted in the command a result file records, and the A/B
    table's command keeps it quoted once it drops the flags the rounds differ in."""
    import shlex

    import results_table

    argv = ['tools/startup.py', '--label=projections as 2-D matmuls (B*T rows)', '--layers=8']
    monkeypatch.setattr(sys, 'argv', argv)
    for name in bench_common.RESULT_ENV:
        monkeypatch.delenv(name, raising=False)
    command = bench_common.run_metadata()['command']
    assert shlex.split(command) == ['python', *argv]
    # A variable that changes the kernels is part of the command, set as a shell sets it.
    monkeypatch.setenv('TF_ENABLE_ONEDNN_OPTS', '0')
    with_env = bench_common.run_metadata()['command']
    assert shlex.split(with_env) == ['TF_ENABLE_ONEDNN_OPTS=0', 'python', *argv]
    rounds = [
        dict(command=f'{command} --cell_grappler --output=/tmp/a.json'),
        dict(command=f'{command} --nocell_grappler --output=/tmp/b.json'),
    ]
    assert results_table._ab_command(rounds) == f'`{command}`' + results_table.AB_NOTE


def test_docs_results_are_the_tools_output():
    """Every results table of the README and the guides is results_table.py's rendering of a
    committed JSON file a tool wrote (`python tools/results_table.py --write` regenerates them
    all): no figure typed by hand, and a stale block fails here."""
    import results_table

    texts = {}
    for path in results_table.doc_files():
        with open(path, encoding='utf-8') as f:
            texts[path] = f.read()
    blocks = [m['files'] for text in texts.values() for m in results_table.BLOCK.finditer(text)]
    for path, text in texts.items():
        assert results_table.stale_blocks(text) == [], path
    for name in (
        'peak_memory',
        'schedules',
        'timeline_gpipe',
        'data_parallel',
        'data_parallel_8192',
        'plan_check',
        'paper_scale',
        'plan_lm1b_tpu_v3',
        'table2',
        'overheads',
        'max_model_size_transformer',
        'fault_drill',
        'startup_grid_l8',
        'startup_grid_l64',
        'demos',
    ):
        assert any(f'docs/results/{name}.json' in b.split() for b in blocks), name
    # A stale block is caught: change one figure of the rendered text.
    text = next(t for t in texts.values() if '| 2446 | 1.38 |' in t)
    changed = text.replace('| 2446 | 1.38 |', '| 2446 | 1.39 |', 1)
    assert changed != text and results_table.stale_blocks(changed)


def test_results_table_leaves_every_page_whole_when_a_file_is_missing(tmp_path, monkeypatch):
    import results_table

    good = tmp_path / 'README.md'
    good.write_text('<!-- results: docs/results/fault_drill.json -->\nold\n<!-- /results -->\n')
    page = tmp_path / 'page.md'
    text = 'intro\n<!-- results: docs/results/no_such_file.json -->\nold\n<!-- /results -->\n'
    page.write_text(text)
    monkeypatch.setattr(results_table, 'doc_files', lambda: [str(good), str(page)])
    before = good.read_text()
    with pytest.raises(FileNotFoundError, match='no_such_file.json'):
        results_table.main(['--write'])
    assert page.read_text() == text and good.read_text() == before


# tools/startup.py at its smallest: K=2 cells of one layer each, one timed steady step.
_STARTUP_SMALL = ['tools/startup.py', '--num_stages=2', '--layers=2', '--steps=1', '--batch_size=8']


def _startup(path, *flags):
    """tools/startup.py at its smallest with `flags`, its result in `path`: (the result, what
    it printed)."""
    printed = _run([*_STARTUP_SMALL, *flags, f'--output={path}'], timeout=600)
    return json.loads(path.read_text()), printed


def test_startup_measures_the_pipeline_beside_the_plain_sequence(tmp_path):
    """tools/startup.py at the smallest scale: every (K, L, M) and schedule in its own
    process, the plain step and the unrolled executor measured there too, the summary's ratios
    (to the plain step of the same process) and growth per micro-batch from the rows."""
    result, printed = _startup(
        tmp_path / 'startup.json',
        '--tick_loop',
        '--compare_unrolled',
        '--micro_batches=2,4',
        '--schedules=1f1b,zero_bubble',
    )
    assert result['command'].startswith('python tools/startup.py')
    kinds = sorted((r['kind'], r['schedule'], r['num_micro_batches']) for r in result['rows'])
    assert kinds == [
        ('pipeline', '1f1b', 2),
        ('pipeline', '1f1b', 4),
        ('pipeline', 'zero_bubble', 2),
        ('pipeline', 'zero_bubble', 4),
        ('plain', '', 2),
        ('plain', '', 2),
        ('plain', '', 4),
        ('plain', '', 4),
        ('unrolled', '1f1b', 2),
        ('unrolled', '1f1b', 4),
        ('unrolled', 'zero_bubble', 2),
        ('unrolled', 'zero_bubble', 4),
    ]
    for r in result['rows']:
        assert r['startup_s'] == pytest.approx(r['trace_s'] + r['first_call_s'])
        assert r['outer_nodes'] > 0 and r['steady_s'] > 0
        assert r['trace_cpu_s'] > 0 and r['first_call_cpu_s'] > 0
        assert 0 <= r['trace_gc_s'] <= r['trace_s'] and r['trace_full_gcs'] >= 0
    # One plain step per schedule's process; each schedule's ratio is to its own.
    assert sorted(r['beside'] for r in result['rows'] if r['kind'] == 'plain') == [
        '1f1b',
        '1f1b',
        'zero_bubble',
        'zero_bubble',
    ]
    rows = {
        (r['kind'], r.get('beside', r['schedule']), r['num_micro_batches']): r
        for r in result['rows']
    }
    for s in result['summary']:
        two, four = rows['pipeline', s['schedule'], 2], rows['pipeline', s['schedule'], 4]
        # The tick loop: the step's program is the same at M=2 and M=4.
        assert s['nodes_per_micro_batch'] == (four['outer_nodes'] - two['outer_nodes']) / 2 == 0
        assert s['growth'] == pytest.approx(four['startup_s'] / two['startup_s'])
        plain = rows['plain', s['schedule'], 4]
        assert s['vs_plain'] == pytest.approx(four['startup_s'] / plain['startup_s'])
        unrolled = rows['unrolled', s['schedule'], 4]
        assert s['unrolled_startup_s'] == pytest.approx(unrolled['startup_s'])
        assert s['unrolled_steady_ms'] == pytest.approx(1e3 * unrolled['steady_s'])
    assert '| 2 | 2 | zero_bubble |' in printed and 'unrolled at M=max' in printed


_GRAPPLER_LOG = """\
I0000 00:00:1796604515.103158    2655 meta_optimizer.cc:1059] Starting optimization for grappler item: __inference_pipe_step_7
W0000 00:00:1796604515.110000    2655 other.cc:1] model_pruner: Graph size after: 1 nodes (0), time = 99ms.
I0000 00:00:1796604515.156347    2655 meta_optimizer.cc:973] model_pruner: Graph size after: 1727 nodes (-439), 3280 edges (-736), time = 17.331ms.
I0000 00:00:1796604515.275172    2655 meta_optimizer.cc:973] tfg_optimizer{any(tfg-toposort,tfg-shape-inference{graph-version=0})}: Graph size after: 1727 nodes (0), 3280 edges (0), time = 114.238ms.
I0000 00:00:1796604516.199655    2655 meta_optimizer.cc:973] model_pruner: Graph size after: 1095 nodes (-632), 2269 edges (0), time = 2.669ms.
I0000 00:00:1796604516.411777    2655 meta_optimizer.cc:1311] Optimized 0 functions:
I0000 00:00:1796604517.000000    2655 meta_optimizer.cc:1059] Starting optimization for grappler item: __inference_unfinished_9
"""


def test_grappler_log_reads_each_items_passes_from_start_to_end():
    """An item's seconds run from its start to its end line; a pass's rounds add up; the
    nodes before are the first pass's size less its change; lines of other files and an item
    the log does not finish are left out."""
    import grappler_log

    items = grappler_log.parse(_GRAPPLER_LOG)
    assert list(items) == ['__inference_pipe_step_7']
    item = items['__inference_pipe_step_7']
    assert item['seconds'] == pytest.approx(516.411777 - 515.103158)
    assert (item['nodes_before'], item['nodes_after']) == (2166, 1095)
    assert item['passes'] == pytest.approx({'model_pruner': 20.0, 'tfg_optimizer': 114.238})


def test_startup_records_what_grappler_did_at_each_first_call(tmp_path):
    """--grappler_passes: every step's row holds Grappler's record from TF's own log (a
    changed log format fails the run), the pipeline's step has calls for the function optimizer
    and the plain step none, and the table renders the passes."""
    result, printed = _startup(
        tmp_path / 'grappler.json', '--micro_batches=2', '--schedules=1f1b', '--grappler_passes'
    )
    rows = {r['kind']: r for r in result['rows']}
    assert sorted(rows) == ['pipeline', 'plain']
    for r in rows.values():
        g = r['grappler']
        assert g['seconds'] > 0 and g['nodes_before'] >= g['nodes_after'] > 0
        assert sum(g['passes'].values()) > 0
    assert rows['pipeline']['grappler']['passes'].get('function_optimizer', 0) > 0
    assert 'function_optimizer' not in rows['plain']['grappler']['passes']
    assert '| plain (beside 1f1b) | 2 | 2 | 2 | 1 |' in printed and 'Grappler s' in printed


def test_startup_runs_without_grappler_on_the_step_when_asked(tmp_path):
    """--nostep_grappler: the experiment's rows say (as TF reports its options in the child)
    that Grappler was off for the plain step and the pipeline's alike; by default it is on."""
    rows = {}
    for flag in ('--nostep_grappler', '--step_grappler'):
        result, printed = _startup(
            tmp_path / f'{flag}.json', flag, '--micro_batches=2', '--schedules=1f1b'
        )
        rows[flag] = result['rows']
        assert ('Grappler off in the whole process' in printed) == (flag == '--nostep_grappler')
    assert sorted(r['kind'] for r in rows['--nostep_grappler']) == ['pipeline', 'plain']
    assert all(r['step_grappler'] is False for r in rows['--nostep_grappler'])
    assert all(r['step_grappler'] is True for r in rows['--step_grappler'])


def test_demo_results_measures_both_demos(tmp_path):
    """The tool behind the quick start's table, on a few steps: its file renders as the table."""
    out = tmp_path / 'demos.json'
    _run(
        ['tools/demo_results.py', f'--out={out}', '--steps_scale=0.01', '--first_step_runs=1'],
        timeout=600,
    )
    result = json.loads(out.read_text())
    assert [r['model'] for r in result['demos']] == [
        'lm.synthetic.TransformerLmTiny',
        'mt.synthetic.TransformerNmtTiny',
    ]
    assert all(r['steps'] in (3, 4) and r['first_step_s'] > 0 for r in result['demos'])
    assert 'bleu' in result['demos'][1] and 'bleu' not in result['demos'][0]
    for r in result['demos']:  # decoding speed, with caches and without: measured
        speed = r['decode_tokens_per_sec']
        assert all(0 < speed[m]['min'] <= speed[m]['median'] for m in ('incremental', 'recompute'))
        fresh = r['first_step_fresh_s']  # make demo's first step, in a new trainer process
        assert fresh['runs'] == 1 and 0 < fresh['min'] == fresh['median'] == fresh['max'], fresh
    table = _run(['tools/results_table.py', str(out)])
    assert '| mt.synthetic.TransformerNmtTiny | 4 | 4 | 1f1b | 4 |' in table


def _startup_file(path, layers, command, growth_at_k4):
    """A tools/startup.py result of one L: K=4 and K=2, 1f1b, M=4 and M=32."""
    summary = [
        dict(
            layers=layers,
            num_stages=k,
            schedule='1f1b',
            startup_s={'4': 2.0, '32': 2.0 * growth},
            growth=growth,
            vs_plain=1.5 * growth,
            plain_startup_s=1.0,
            nodes_per_micro_batch=0,
            steady_ms=30.0,
            plain_steady_ms=10.0,
            smallest_m=4,
            largest_m=32,
            unrolled_startup_s=8.0 * growth,
            unrolled_steady_ms=25.0,
            steady_ratio=1.2,
            steady_ratio_range=[1.1, 1.3],
        )
        for k, growth in ((2, 1.0), (4, growth_at_k4))
    ]
    meta = dict(machine='m', tf_version='2', date=f'd{layers}', command=command)
    path.write_text(
        json.dumps(
            dict(meta, startup=True, engine='e', model='t', recompute='r', rows=[], summary=summary)
        )
    )
    return str(path)


def test_startup_runs_of_one_grid_render_as_one_table_with_the_goals(tmp_path):
    """Several tools/startup.py files in one results block (a grid run per L): one table, each
    run's command, and engine v3's goals computed from its rows."""
    import results_table

    paths = [
        _startup_file(tmp_path / 'a.json', 8, 'python tools/startup.py --layers=8', 1.1),
        _startup_file(tmp_path / 'b.json', 64, 'python tools/startup.py --layers=64', 1.5),
    ]
    lines = results_table.table(paths)
    text = '\n'.join(lines)
    assert lines[0].startswith('Written d8 to d64 on m, TF 2 (')
    assert '`python tools/startup.py --layers=8`; `python tools/startup.py --layers=64`' in lines[0]
    assert sum(line.startswith('| ') and '| 1f1b |' in line for line in lines) == 4
    goals = lines[-1]
    assert 'at most 1.3 in 3 of 4 rows (the largest 1.50: L=64, K=4, 1f1b)' in goals
    # vs plain = 1.5 x growth at K=4: 1.65 (L=8) and 2.25 (L=64); one within 2x.
    assert 'at K=4 and M=32, 1.65–2.25 times the plain' in goals
    assert 'at most 2 in 1 of 2 rows' in goals
    assert '0 in every row (L = 8, 64)' in goals
    assert "start-up at M=32 0.25 times the unrolled executor's" in goals  # 2g / 8g
    assert text.count('| L | K | schedule |') == 1


def test_startup_repeats_take_medians_of_rounds_and_show_the_spread():
    """tools/startup.py --repeats: each start-up is the median of its fresh processes with
    their range; growth, the ratio to plain and the growth net of the first call's step are
    medians of each round's own ratios (rounds run M after M, so one busy moment slows a
    round's M alike)."""
    import results_table
    import startup

    rows = []
    # Three rounds; round 1 is busy: everything in it 1.5x slower.
    for run, busy in ((0, 1.0), (1, 1.5), (2, 1.0)):
        for m, pipe, steady in ((4, 8.0 + run, 0.1), (32, 9.0 + run, 0.5)):
            common = dict(layers=16, num_stages=4, num_micro_batches=m, run=run, outer_nodes=1)
            rows.append(
                dict(common, kind='plain', schedule='', startup_s=3.0 * busy, steady_s=0.05)
            )
            rows.append(
                dict(
                    common,
                    kind='pipeline',
                    schedule='1f1b',
                    startup_s=pipe * busy,
                    steady_s=steady * busy,
                    steady_all=[steady],
                )
            )
    (s,) = startup.summarise(rows)
    assert s['runs'] == 3 and s['nodes_per_micro_batch'] == 0
    assert s['startup_s'] == {'4': 10.0, '32': 11.0}  # medians of 8, 13.5, 10 and 9, 15, 11
    assert s['startup_range'] == {'4': [8.0, 13.5], '32': [9.0, 15.0]}
    assert s['growth'] == pytest.approx(10 / 9)  # per round 9 / 8, 15 / 13.5, 11 / 10
    net = sorted([(9 - 0.5) / (8 - 0.1), (15 - 0.75) / (13.5 - 0.15), (11 - 0.5) / (10 - 0.1)])
    assert s['growth_net_of_step'] == pytest.approx(net[1])
    assert s['vs_plain'] == pytest.approx(10 / 3)  # per round 3.0, 3.33, 3.67
    # Over each process's plain step (3.0 x busy at both M): per round 9 / 8, 15 / 13.5, 11 / 10.
    assert s['growth_vs_plain'] == pytest.approx(10 / 9)
    line = next(x for x in results_table.startup_table(
        dict(engine='e', model='t', recompute='r', summary=[s])) if x.startswith('| 16 |'))  # fmt: skip
    assert line.startswith('| 16 | 4 | 1f1b | 10.0 (8.0–13.5) | 11.0 (9.0–15.0) | 1.11 | 1.07 |')


def test_startup_growth_over_each_process_plain_step_takes_out_the_host_drift():
    """A host twice as slow for the M=32 process doubles its plain step too: the raw growth
    is 2, the growth over each process's plain step 1, and the goals line reports both."""
    import results_table
    import startup

    rows = []
    for m, slow in ((4, 1.0), (32, 2.0)):
        common = dict(layers=16, num_stages=4, num_micro_batches=m, outer_nodes=5, steady_s=0.1)
        rows.append(dict(common, kind='plain', schedule='', beside='1f1b', startup_s=2.0 * slow))
        rows.append(dict(common, kind='pipeline', schedule='1f1b', startup_s=4.0 * slow))
    (s,) = startup.summarise(rows)
    assert s['growth'] == pytest.approx(2.0)
    assert s['growth_vs_plain'] == pytest.approx(1.0)
    goals = results_table.startup_goals([s])[-1]
    assert 'at most 1.3 in 0 of 1 rows (the largest 2.00' in goals
    assert "each over the plain step's start-up in its process, at most 1.3 in 1 of 1" in goals


def test_startup_summarise_rewrites_a_file_summary_from_its_rows(tmp_path):
    """--summarise=FILE measures nothing: the summary is recomputed from the rows (a file
    written before a summary field existed gets it), the rows left as they are."""
    rows = []
    for m, slow in ((4, 1.0), (32, 2.0)):
        common = dict(layers=8, num_stages=2, num_micro_batches=m, outer_nodes=5, steady_s=0.1)
        rows.append(dict(common, kind='plain', schedule='', beside='gpipe', startup_s=2.0 * slow))
        rows.append(dict(common, kind='pipeline', schedule='gpipe', startup_s=4.0 * slow))
    path = tmp_path / 'old.json'
    old = dict(startup=True, engine='e', model='t', recompute='r', rows=rows, summary=[])
    path.write_text(json.dumps(old))
    out = _run(['tools/startup.py', f'--summarise={path}'])
    new = json.loads(path.read_text())
    assert new['rows'] == rows
    (s,) = new['summary']
    assert s['growth_vs_plain'] == pytest.approx(1.0) and s['growth'] == pytest.approx(2.0)
    assert '| 8 | 2 | gpipe | 4.0 | 8.0 | 2.00 |' in out


def test_startup_measures_eval_once_per_process_whatever_the_schedules(tmp_path):
    """--measure=eval (or fprop) measures one call per (K, L, M), not one per --schedules
    entry: one process each, its plain step beside it, and the summary's ratio to that one."""
    out = tmp_path / 'eval.json'
    _run(
        [
            'tools/startup.py',
            '--measure=eval',
            '--num_stages=2',
            '--layers=2',
            '--micro_batches=2,4',
            '--steps=1',
            '--batch_size=8',
            f'--output={out}',
        ],
        timeout=600,
    )
    result = json.loads(out.read_text())
    kinds = sorted((r['kind'], r['schedule'], r['num_micro_batches']) for r in result['rows'])
    assert kinds == [
        ('pipeline', 'eval', 2),
        ('pipeline', 'eval', 4),
        ('plain', '', 2),
        ('plain', '', 4),
    ]
    assert [s['schedule'] for s in result['summary']] == ['eval']


def test_startup_ab_table_keeps_each_executor_apart_and_each_round_to_its_own_plain_step():
    """Two versions' rounds with the tick loop and the unrolled executor measured in each
    process: one row per version and executor, and the start-up over the plain step of the
    process that measured it (a busy round slows both alike)."""
    import results_table

    def result(label, slow):
        common = dict(layers=8, num_stages=2, num_micro_batches=4, steady_s=0.1, outer_nodes=5)
        rows = [
            dict(common, kind='plain', schedule='', beside='gpipe', startup_s=2.0 * slow),
            dict(common, kind='pipeline', schedule='gpipe', startup_s=4.0 * slow),
            dict(common, kind='unrolled', schedule='gpipe', startup_s=6.0 * slow),
        ]
        rows = [
            dict(r, trace_s=r['startup_s'] / 2, first_call_s=r['startup_s'] / 2, library_nodes=7)
            for r in rows
        ]
        meta = dict(model='t', recompute='r', machine='m', tf_version='v', date='d')
        return dict(meta, startup=True, engine=label, command='c', rows=rows)

    lines = results_table.startup_ab_table([result('a', 1.0), result('a', 3.0), result('b', 1.0)])
    body = [line for line in lines if line.startswith('| a') or line.startswith('| b')]
    assert len(body) == 4  # (pipeline, unrolled) x (a, b)
    # a: start-ups 4 and 12 over plain steps of 2 and 6: 2.00 in both rounds.
    assert '| a | 8 | 2 | 4 | gpipe (tick loop) | 2 | ' in body[0]
    assert body[0].endswith('| 2.00 [2.00–2.00] | 5 + 7 | 1.00 |')
    assert body[1].startswith('| b | 8 | 2 | 4 | gpipe (tick loop) | 1 |')
    assert body[1].endswith('| 2.00 [2.00–2.00] | 5 + 7 | 0.50 |')  # 4 against a's median 8
    assert '| gpipe (unrolled) |' in body[2]
    assert body[2].endswith('| 3.00 [3.00–3.00] | 5 + 7 | 1.00 |')


def test_startup_ab_table_shows_the_traces_collections_when_every_row_has_them():
    """Rounds that recorded their traces' garbage collections get two more columns (the
    pipeline's and its process's plain step's); older files render as they always did."""
    import results_table

    def result(label, gc_s, full, with_gc=True):
        common = dict(layers=8, num_stages=2, num_micro_batches=4, steady_s=0.1, outer_nodes=5)
        common.update(trace_s=1.0, first_call_s=1.0, startup_s=2.0, library_nodes=7)
        rows = [
            dict(
                common, kind='plain', schedule='', beside='1f1b', trace_gc_s=0.2, trace_full_gcs=1
            ),
            dict(common, kind='pipeline', schedule='1f1b', trace_gc_s=gc_s, trace_full_gcs=full),
        ]
        if not with_gc:
            rows = [{k: v for k, v in r.items() if not k.startswith('trace_')} for r in rows]
            rows = [dict(r, trace_s=1.0) for r in rows]
        meta = dict(model='t', recompute='r', machine='m', tf_version='v', date='d')
        return dict(meta, startup=True, engine=label, command='c', rows=rows)

    lines = results_table.startup_ab_table(
        [result('a', 0.3, 1), result('a', 0.5, 2), result('b', 0.07, 1)]
    )
    assert lines[2].endswith(
        "| of the trace, in GC s (full ones) | the plain step's, in GC s (full ones) |"
    )
    assert lines[3].count('|') == lines[2].count('|')
    a, b = (line for line in lines if line.startswith(('| a', '| b')))
    assert a.endswith('| 1.00 | 0.40 [0.30–0.50] (1–2) | 0.20 [0.20–0.20] (1) |')
    assert b.endswith('| 1.00 | 0.07 [0.07–0.07] (1) | 0.20 [0.20–0.20] (1) |')
    old = results_table.startup_ab_table([result('a', 0, 0, False), result('b', 0, 0, False)])
    assert 'GC' not in old[2] and old[3] == '|---|' + '---|' * 12
