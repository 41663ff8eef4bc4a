"""The docs run as written. Every Python block of the README and the guides (docs/*.md) is run
by a test here: most in this process (TF is already started with the four logical CPUs the
examples ask for, so each example's `cluster.logical_cpus(4)` is a no-op), a TF cluster's
client and the TPU example in processes of their own. Every shell block names make targets,
tools and flags that exist, and the README's links lead to pages and headings that exist (the
guides' own links and anchors are checked by the strict docs build, `make docs`)."""

import contextlib
import glob
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import traceback
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ['README.md', 'CHANGELOG.md'] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs', '*.md'))
)


def _read(page):
    with open(os.path.join(ROOT, page), encoding='utf-8') as f:
        return f.read()


def _blocks(lang):
    """(page, code) of every fenced block in `lang` ('' for a fence without one)."""
    found = []
    for page in PAGES:
        for fence_lang, code in re.findall(r'^```(\S*)\n(.*?)^```', _read(page), re.S | re.M):
            if fence_lang == lang:
                found.append((page, code))
    return found


def _python_blocks():
    return [code for _, code in _blocks('python')]


def _block(marker):
    """The one Python block that contains `marker`."""
    matches = [b for b in _python_blocks() if marker in b]
    assert len(matches) == 1, f'{len(matches)} Python blocks contain {marker!r}'
    return matches[0]


# The test that runs each Python block, by a marker only that block contains.
RUN_BY = {
    'class TinyLm(': 'test_readme_trainer_example_trains',
    '# a keras.Model, in 2 cells': 'test_readme_keras_example_trains',
    'num_haeds': 'test_params_example_fails_only_at_the_documented_typo',
    'class TransformerLmTiny(': 'test_params_class_example_is_the_registered_file',
    "partition_by='flops', input_shape=(32, 64)": 'test_pipeline_example_trains',
    "pipe.save('/tmp/pipe.keras')": 'test_keras_example_trains_saves_and_restores',
    'keras.applications.ResNet50': 'test_keras_resnet_example_runs',
    'compute_gradients': 'test_keras_custom_loop_example_trains_under_gpipe_and_1f1b',
    'DeviceMesh.from_local(num_replicas=2': 'test_strategy_example_trains_data_x_pipeline',
    'tpu_mesh(': 'test_tpu_example_says_no_tpu_answered_off_a_tpu',
    'TFConfigClusterResolver': 'test_cluster_client_example_trains_on_two_tf_workers',
    'planning.recommend(': 'test_planning_example_ranks_plans',
}


def test_every_python_block_is_run_by_a_test():
    blocks = _blocks('python')
    assert len(blocks) >= len(RUN_BY)
    for page, code in blocks:
        markers = [m for m in RUN_BY if m in code]
        assert len(markers) == 1, f'{page}: a Python block run by {len(markers)} tests:\n{code}'
    for marker, test in RUN_BY.items():
        assert test in globals(), test
        _block(marker)  # exactly one block each


def test_every_fenced_block_names_its_language():
    """A block without a language would escape the checks here (and lose its highlighting)."""
    assert _blocks('') == []


def _run(code):
    """Runs `code` as a fresh script would (own globals, a scratch working directory): its
    returncode (1 on any exception), stdout and stderr (the traceback)."""
    out, err, returncode = io.StringIO(), io.StringIO(), 0
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    exec(compile(code, '<docs example>', 'exec'), {'__name__': '__main__'})
                except BaseException:  # noqa: BLE001 (SystemExit included: a script's exit)
                    traceback.print_exc()
                    returncode = 1
        finally:
            os.chdir(here)
    return types.SimpleNamespace(
        returncode=returncode, stdout=out.getvalue(), stderr=err.getvalue()
    )


def _run_process(code, env=None, timeout=300):
    """Runs `code` in a fresh Python process (for examples that connect TF to a cluster)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', **(env or {}))
    return subprocess.run(
        [sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=timeout,
        cwd=tempfile.gettempdir(),
    )  # fmt: skip


def test_readme_trainer_example_trains():
    result = _run(_block('class TinyLm('))
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'trained to step 40' in result.stdout, result.stdout


def test_readme_keras_example_trains():
    result = _run(_block('# a keras.Model, in 2 cells'))
    assert result.returncode == 0, result.stderr[-2000:]
    assert '/device:CPU:1' in result.stdout, result.stdout
    assert float(result.stdout.split('accuracy ')[-1]) > 0.9, result.stdout


def test_params_class_example_is_the_registered_file():
    """The guide's params class is `params/lm/synthetic.py`'s, character for character, and
    run as a script it gives the registered model's params."""
    block = _block('class TransformerLmTiny(')
    assert block in _read('params/lm/synthetic.py')
    check = (
        '\nfrom tf_gpipe import model_registry as _registry\n'
        "_mine = TransformerLmTiny().Task().ToText()\n"
        f'_registry.LoadParamsDir({os.path.join(ROOT, "params")!r})\n'
        "_file = _registry.GetClass('lm.synthetic.TransformerLmTiny')().Task().ToText()\n"
        "print('same task params', _mine == _file)\n"
    )  # fmt: skip
    result = _run(block + check)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'same task params True' in result.stdout


def test_params_example_fails_only_at_the_documented_typo():
    block = _block('num_haeds')
    result = _run(block)
    assert result.returncode != 0
    assert "AttributeError: Params has no parameter 'num_haeds' (did you mean 'num_heads'?)" in (
        result.stderr
    )
    fixed = _run(block.replace('p.sub[1].num_haeds = 2', 'p.sub[1].num_heads = 2'))
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert 'sub[1].num_heads : 2' in fixed.stdout


def test_pipeline_example_trains():
    result = _run(_block("partition_by='flops', input_shape=(32, 64)"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'fc6 .. softmax (3)' in result.stdout and '(32, 10)' in result.stdout
    assert 'device 3: F3.0 B3.0 F3.1 B3.1' in result.stdout and '1f1b loss' in result.stdout


def test_keras_example_trains_saves_and_restores():
    result = _run(_block("pipe.save('/tmp/pipe.keras')"))
    assert result.returncode == 0, result.stderr[-2000:]
    accuracy = float(re.search(r'accuracy (\d\.\d+)', result.stdout).group(1))
    assert accuracy > 0.9, result.stdout
    assert 'dense' in result.stdout and '/device:CPU:3' in result.stdout
    assert result.stdout.rstrip().endswith('True'), result.stdout


def test_keras_resnet_example_runs():
    result = _run(_block('keras.applications.ResNet50'))
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'GPipe: 4 cells, 2 micro-batches' in result.stdout, result.stdout[-3000:]
    assert '/device:CPU:3' in result.stdout
    assert re.search(r'\[\d+, \d+, \d+, \d+\]', result.stdout.splitlines()[-1]), result.stdout[
        -500:
    ]


def test_keras_cut_after_example_names_real_resnet50_layers():
    import keras

    sentence = re.search(r'GPipe\(resnet, cut_after=\[([^\]]*)\]', _read('docs/keras.md'))
    names = re.findall(r"'([^']+)'", sentence.group(1))
    resnet = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    assert names and set(names) <= {layer.name for layer in resnet.layers}, names


def test_strategy_example_trains_data_x_pipeline():
    block = _block('DeviceMesh.from_local(num_replicas=2')
    setup = (  # the user's model and data; the CPU is split first, as the example says
        'from tf_gpipe import cluster\ncluster.logical_cpus(4)\nimport keras, numpy as np\n'
        'keras_model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, '
        "activation='relu'), keras.layers.Dense(16, activation='relu'), "
        "keras.layers.Dense(2, activation='softmax')])\n"
        'x = np.random.RandomState(0).randn(256, 8).astype("float32")\n'
        'y = (x.sum(1) > 0).astype("int32")\n'
    )
    check = (
        '\nprint([[c.device[-5:] for c in w.value.values] for w in model.trainable_weights])\n'
        "print('loss', model.evaluate(x, y, verbose=0))\n"
    )
    result = _run(setup + block + check)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "['CPU:0', 'CPU:2']" in result.stdout and "['CPU:1', 'CPU:3']" in result.stdout
    assert 0 < float(result.stdout.split('loss ')[-1]) < 1, result.stdout


def test_keras_custom_loop_example_trains_under_gpipe_and_1f1b():
    result = _run(_block('compute_gradients'))
    assert result.returncode == 0, result.stderr[-2000:]
    losses = re.search(
        r'loss after 30 steps: (\d\.\d+) \(gpipe\), (\d\.\d+) \(1f1b\)', result.stdout
    )
    assert losses, result.stdout
    assert all(float(v) < 0.5 for v in losses.groups()), result.stdout  # from ln 2 = 0.69


def test_tpu_example_says_no_tpu_answered_off_a_tpu():
    """No TPU here: the example gets as far as the guide says it does, and stops with the
    error the guide quotes (in its own process: connecting to a TPU system changes TF's
    context)."""
    result = _run_process(_block('tpu_mesh('))
    assert result.returncode == 1
    assert "RuntimeError: No TPU answered for tpu='local'" in result.stderr, result.stderr[-2000:]


def test_cluster_client_example_trains_on_two_tf_workers():
    """The client program of the guide, as written, against two TF worker processes on
    loopback named by TF_CONFIG (the client in its own process: connecting to a cluster
    changes TF's context for good)."""
    from tf_gpipe.runtime import local_cluster

    with local_cluster.LocalCluster(2) as workers:
        config = {'cluster': workers.spec, 'task': {'type': 'client', 'index': 0}}
        result = _run_process(
            _block('TFConfigClusterResolver'), env={'TF_CONFIG': json.dumps(config)}
        )
    assert result.returncode == 0, result.stderr[-3000:]
    loss = float(re.search(r'loss after 10 steps: (\S+)', result.stdout).group(1))
    assert 0 < loss < 10, result.stdout


def test_planning_example_ranks_plans():
    result = _run(_block('planning.recommend('))
    assert result.returncode == 0, result.stderr[-2000:]
    first = re.search(
        r'M=(\d+) (\w+) recompute=(\w+): peak ([\d.]+) GiB.*fits (\w+)', result.stdout
    )
    assert first and first.group(5) == 'True', result.stdout
    peaks = re.search(r'per device GiB: \[(.*)\]', result.stdout).group(1).split(', ')
    assert len(peaks) == 8 and max(map(float, peaks)) == pytest.approx(
        float(first.group(4)), abs=0.1
    )


def _makefile_targets():
    lines = re.findall(r'^([\w.-]+(?: [\w.-]+)*):', _read('Makefile'), re.M)
    return {target for line in lines for target in line.split()}


def _tool_flags(tool):
    """The absl flags tools/<tool>.py defines (with those of the tools modules it imports)."""
    source = _read(f'tools/{tool}.py')
    for module in re.findall(r'^import (\w+)$|^from (\w+) import', source, re.M):
        name = module[0] or module[1]
        if os.path.exists(os.path.join(ROOT, 'tools', f'{name}.py')):
            source += _read(f'tools/{name}.py')
    return set(re.findall(r"DEFINE_\w+\(\s*'(\w+)'", source))


def _commands():
    """Every command of every shell block, as (page, words): continuations and quotes that
    span lines joined, comments dropped."""
    for page, code in _blocks('sh'):
        pending = ''
        for line in code.replace('\\\n', ' ').splitlines():
            pending += line + '\n'
            if pending.count("'") % 2:  # a quoted argument goes on
                continue
            words = shlex.split(pending, comments=True)
            pending = ''
            if words:
                yield page, words


def test_shell_blocks_name_targets_tools_and_flags_that_exist():
    targets = _makefile_targets()
    tools = {'tf_gpipe_trainer': 'trainer', 'tf_gpipe_worker': 'worker'}
    checked = 0
    for page, words in _commands():
        words = [w for w in words if not re.match(r'^\w+=', w)]  # an environment assignment
        if not words or words[0] in ('export', 'tensorboard'):
            continue
        if words[0] == 'make':
            assert set(words[1:]) <= targets, f'{page}: no make target {words[1:]}'
        else:
            if words[:2] == ['python', '-m']:
                assert words[2] == 'tf_gpipe.runtime.worker', f'{page}: {words}'
                continue
            tool = tools.get(words[0]) or re.fullmatch(r'tools/(\w+)\.py', words[1]).group(1)
            flags = {w[2:].split('=')[0] for w in words if w.startswith('--')}
            unknown = flags - _tool_flags(tool)
            assert not unknown, f'{page}: tools/{tool}.py has no flag {sorted(unknown)}'
        checked += 1
    assert checked >= 15, checked


def _slug(heading):
    """GitHub's (and MyST's) anchor of a heading."""
    text = re.sub(r'[`*]', '', heading).strip().lower()
    return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def test_readme_and_changelog_links_lead_somewhere():
    for page in ('README.md', 'CHANGELOG.md'):
        for target in re.findall(r'\]\(([^)\s]+)\)', _read(page)):
            if re.match(r'https?://', target):
                continue
            path, _, anchor = target.partition('#')
            assert os.path.exists(os.path.join(ROOT, path)), f'{page}: {target}'
            if anchor:
                headings = re.findall(r'^#+ (.*)$', _read(path), re.M)
                assert anchor in {_slug(h) for h in headings}, f'{page}: {target}'


def test_slug_is_githubs():
    assert _slug('Start-up: the tick loop (`tick_loop=True`, opt-in)') == (
        'start-up-the-tick-loop-tick_looptrue-opt-in'
    )
    assert _slug('Data x pipeline under `tf.distribute` (the backend)') == (
        'data-x-pipeline-under-tfdistribute-the-backend'
    )


def test_the_docs_build_fails_on_a_broken_link(tmp_path):
    """`make docs` is strict: a link to a heading that does not exist fails the build."""
    import shutil

    docs = tmp_path / 'docs'
    shutil.copytree(os.path.join(ROOT, 'docs'), docs, ignore=shutil.ignore_patterns('_build'))
    shutil.copy(os.path.join(ROOT, 'CHANGELOG.md'), tmp_path / 'CHANGELOG.md')
    with open(docs / 'glossary.md', 'a', encoding='utf-8') as f:
        f.write('\nSee [the engine](engine.md#no-such-heading).\n')
    sphinx = os.path.join(os.path.dirname(sys.executable), 'sphinx-build')
    build = [
        sphinx,
        '-q',
        '-W',
        '--keep-going',
        '-n',
        '-b',
        'html',
        str(docs),
        str(tmp_path / 'out'),
    ]
    result = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "local id not found in doc 'engine': 'no-such-heading'" in result.stderr, result.stderr
