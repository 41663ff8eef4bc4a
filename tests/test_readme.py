"""The README's examples run as written (in this process: TF is already started with the four
logical CPUs the examples ask for, so each example's `cluster.logical_cpus(4)` is a no-op)."""

import contextlib
import io
import os
import re
import tempfile
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks():
    with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
        return re.findall(r'```python\n(.*?)```', f.read(), flags=re.S)


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
                    exec(compile(code, '<README example>', 'exec'), {'__name__': '__main__'})
                except BaseException:  # noqa: BLE001 (SystemExit included: a script's exit)
                    traceback.print_exc()
                    returncode = 1
        finally:
            os.chdir(here)
    return types.SimpleNamespace(
        returncode=returncode, stdout=out.getvalue(), stderr=err.getvalue()
    )


def test_params_example_fails_only_at_the_documented_typo():
    block = next(b for b in _python_blocks() if 'num_haeds' in b)
    result = _run(block)
    assert result.returncode != 0
    assert "AttributeError: Params has no parameter 'num_haeds' (did you mean 'num_heads'?)" in (
        result.stderr
    )
    fixed = _run(block.replace('p.sub[1].num_haeds = 2', 'p.sub[1].num_heads = 2'))
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert 'sub[1].num_heads : 2' in fixed.stdout


def test_pipeline_example_trains():
    block = next(b for b in _python_blocks() if 'gpipe.PipelinedLayer' in b)
    result = _run(block)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'fc6 .. softmax (3)' in result.stdout and '(32, 10)' in result.stdout
    assert 'device 3: F3.0 B3.0 F3.1 B3.1' in result.stdout and '1f1b loss' in result.stdout


def test_keras_example_trains_saves_and_restores():
    block = next(b for b in _python_blocks() if 'from tf_gpipe.keras import GPipe' in b)
    result = _run(block)
    assert result.returncode == 0, result.stderr[-2000:]
    accuracy = float(re.search(r'accuracy (\d\.\d+)', result.stdout).group(1))
    assert accuracy > 0.9, result.stdout
    assert 'dense' in result.stdout and '/device:CPU:3' in result.stdout
    assert result.stdout.rstrip().endswith('True'), result.stdout


def test_keras_resnet_example_runs():
    block = next(b for b in _python_blocks() if 'keras.applications.ResNet50' in b)
    result = _run(block)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'GPipe: 4 partitions, 2 micro-batches' in result.stdout, result.stdout[-3000:]
    assert '/device:CPU:3' in result.stdout
    assert re.search(r'\[\d+, \d+, \d+, \d+\]', result.stdout.splitlines()[-1]), result.stdout[
        -500:
    ]


def test_keras_cut_after_example_names_real_resnet50_layers():
    import keras

    with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
        sentence = re.search(r'GPipe\(resnet, cut_after=\[([^\]]*)\]', f.read())
    names = re.findall(r"'([^']+)'", sentence.group(1))
    resnet = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    assert names and set(names) <= {layer.name for layer in resnet.layers}, names


def test_strategy_example_trains_data_x_pipeline():
    block = next(
        b for b in _python_blocks() if 'mesh.strategy().scope()' in b and 'from_local' in b
    )
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
    block = next(b for b in _python_blocks() if 'compute_gradients' in b)
    result = _run(block)
    assert result.returncode == 0, result.stderr[-2000:]
    losses = re.search(
        r'loss after 30 steps: (\d\.\d+) \(gpipe\), (\d\.\d+) \(1f1b\)', result.stdout
    )
    assert losses, result.stdout
    assert all(float(v) < 0.5 for v in losses.groups()), result.stdout  # from ln 2 = 0.69
