"""TensorBoard shows the pipeline: a timestamped step's busy time per device and measured
bubble, parameter norms, peak memory where TF reports it; the timestamped step trains alike."""

import glob
import json
import os
import subprocess
import sys

import numpy as np

from tf_gpipe import hyperparams, model_registry
from tf_gpipe.trainer import pipeline_summaries, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _params(overrides):
    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    model = model_registry.GetClass('lm.synthetic.TransformerLmTiny')()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    hyperparams.apply_overrides(
        p,
        'task.pipeline.num_partitions=2; task.pipeline.num_micro_batches=2; '
        'task.train.max_steps=4; task.train.log_interval_steps=2; ' + overrides,
    )
    return p


def _scalars(event_dir):
    import tensorflow as tf

    out = {}
    for path in glob.glob(os.path.join(event_dir, 'events.*')):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, float(tf.make_ndarray(v.tensor))))
    return out


def test_timestamped_steps_write_busy_time_and_bubble_and_train_alike(tmp_path):
    traced = trainer.Trainer(_params('task.train.trace_interval_steps=2'), str(tmp_path / 'a'))
    plain = trainer.Trainer(_params(''), str(tmp_path / 'b'))
    got, want = traced.Train(), plain.Train()
    np.testing.assert_allclose(got['loss'], want['loss'], rtol=1e-6)
    scalars = _scalars(str(tmp_path / 'a' / 'train'))
    assert [s for s, _ in scalars['pipeline/bubble']] == [2, 4]
    assert all(0.0 <= b < 1.0 for _, b in scalars['pipeline/bubble'])
    for k in (0, 1):
        assert all(ms > 0 for _, ms in scalars[f'pipeline/device_{k}_busy_ms'])
    step_ms = dict(scalars['pipeline/step_ms'])
    assert all(ms >= dict(scalars['pipeline/device_0_busy_ms'])[s] for s, ms in step_ms.items())
    assert scalars['param_norm'][-1][1] > 0
    assert 'pipeline/bubble' not in _scalars(str(tmp_path / 'b' / 'train'))


def test_step_profile_from_timestamps():
    meta = [('F', 0, 0), ('F', 1, 0), ('B', 1, 0), ('B', 0, 0)]
    stamps = [[0.0, 1.0], [1.0, 2.0], [2.0, 4.0], [4.0, 6.0]]
    profile = pipeline_summaries.step_profile(meta, stamps, 2)
    assert profile['step_ms'] == 6000.0
    assert profile['device_0_busy_ms'] == 3000.0 and profile['device_1_busy_ms'] == 3000.0
    assert profile['bubble'] == 0.5


def test_peak_memory_where_tf_reports_it():
    code = (
        'import json\n'
        'import tensorflow as tf\n'
        'from tf_gpipe.trainer import pipeline_summaries\n'
        'x = tf.ones([256, 1024])\n'
        "print(json.dumps(pipeline_summaries.peak_memory(['/device:CPU:0'])))\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', TF_CPU_ALLOCATOR_USE_BFC='true')
    done = subprocess.run(
        [sys.executable, '-c', code], capture_output=True, text=True, timeout=300, env=env,
        cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    peak = json.loads(done.stdout.strip().splitlines()[-1])
    assert peak['CPU_0_peak_mb'] >= 1.0
