"""tools/trainer.py end to end: train (checkpoints, summaries, falling loss), eval, resume,
inspect, and clear errors for a misspelt model or override."""

import glob
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = 'lm.synthetic.TransformerLmTiny'


def _trainer(*args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, 'tools', 'trainer.py'), *args],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=ROOT,
    )


def _scalars(event_dir, tag):
    values = []
    for path in sorted(glob.glob(os.path.join(event_dir, 'events.*'))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                if v.tag == tag:
                    values.append((event.step, float(tf.make_ndarray(v.tensor))))
    return sorted(values)


def test_train_eval_resume(tmp_path):
    logdir = str(tmp_path / 'lm')
    fast = (
        'task.train.log_interval_steps=10; task.train.save_interval_steps=20; '
        'task.pipeline.num_partitions=2; task.pipeline.num_micro_batches=2'  # less to trace
    )
    run = _trainer(  # evaluates at step 40 in the same process (--mode=eval alone: below)
        f'--model={MODEL}',
        f'--logdir={logdir}',
        '--num_logical_cpus=4',
        '--max_steps=40',
        '--mode=train_and_eval',
        f'--params_override={fast}; task.eval.interval_steps=40',
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert 'steps/s' in run.stderr and 'examples/s' in run.stderr
    # Progress: the tracing announced, then percentage and ETA on each log line.
    assert 'Tracing the training step' in run.stderr and 'First step done in' in run.stderr
    assert re.search(r'Traced the training step in [\d.]+ s: \d+ ops in the step', run.stderr)
    assert '  50%  ETA ' in run.stderr and '  100%' in run.stderr
    assert sorted(os.path.basename(p) for p in glob.glob(f'{logdir}/checkpoints/ckpt-*.index')) == [
        'ckpt-20.index',
        'ckpt-40.index',
    ]
    losses = _scalars(f'{logdir}/train', 'loss')
    assert [s for s, _ in losses] == [1, 10, 20, 30, 40]
    assert losses[-1][1] < 0.5 * losses[0][1], losses
    for tag in ('accuracy', 'learning_rate', 'grad_norm', 'steps_per_sec', 'examples_per_sec'):
        assert _scalars(f'{logdir}/train', tag), tag

    accuracy = _scalars(f'{logdir}/eval', 'accuracy')
    assert accuracy[0][0] == 40 and accuracy[0][1] > 0.3

    # Resumed under 2 data-parallel replicas (a MirroredStrategy over 2 x 2 logical CPUs).
    more = _trainer(
        f'--model={MODEL}',
        f'--logdir={logdir}',
        '--num_logical_cpus=4',
        '--num_replicas=2',
        '--max_steps=50',
        f'--params_override={fast}',
    )
    assert more.returncode == 0, more.stderr[-3000:]
    assert 'Data parallel under MirroredStrategy' in more.stderr
    assert 'ckpt-40 (step 40)' in more.stderr and 'Training from step 40 to 50' in more.stderr
    assert os.path.exists(f'{logdir}/checkpoints/ckpt-50.index')
    losses = _scalars(f'{logdir}/train', 'loss')
    assert [s for s, _ in losses][-1] == 50 and losses[-1][1] < 0.5 * losses[0][1], losses

    # The export mode (served and compared in test_export.py): the newest checkpoint, once.
    export_dir = str(tmp_path / 'export')
    exported = _trainer(
        f'--model={MODEL}', f'--logdir={logdir}', '--mode=export', f'--export_dir={export_dir}'
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f'Exported {logdir}/checkpoints/ckpt-50 to {export_dir}.' in exported.stdout
    assert tf.saved_model.load(export_dir).signatures['serving_default'] is not None
    again = _trainer(
        f'--model={MODEL}', f'--logdir={logdir}', '--mode=export', f'--export_dir={export_dir}'
    )
    assert again.returncode == 1 and 'already holds a SavedModel' in again.stderr
    assert 'Traceback' not in again.stderr


def test_inspect_and_errors(tmp_path):
    params = _trainer(
        f'--model={MODEL}',
        '--mode=inspect_params',
        '--params_override=task.pipeline.num_micro_batches=16',
    )
    assert params.returncode == 0, params.stderr[-2000:]
    assert 'task.pipeline.num_micro_batches : 16' in params.stdout
    assert 'input.batch_size : 64' in params.stdout
    model = _trainer(f'--model={MODEL}', '--mode=inspect_model')
    assert model.returncode == 0 and 'total parameters: 208,320' in model.stdout
    typo = _trainer('--model=lm.synthetic.TransformerLmTni', '--mode=inspect_params')
    assert typo.returncode == 1
    assert "Did you mean 'lm.synthetic.TransformerLmTiny'" in typo.stderr
    assert 'Traceback' not in typo.stderr
    # A misspelt or mistyped override takes the same one-line exit as the zero below (their
    # messages: test_hyperparams.py::test_apply_overrides, ::test_from_text_type_errors_and_typos).
    zero = _trainer(
        f'--model={MODEL}',
        '--mode=inspect_model',
        '--params_override=task.pipeline.num_micro_batches=0',
    )
    assert zero.returncode == 1 and 'num_micro_batches=0 must be int >= 1' in zero.stderr
    assert 'Traceback' not in zero.stderr
    # Errors once training starts (too few devices, no TPU; a malformed --cluster_spec, whose
    # messages test_cluster_spec.py checks) take the one-line exit below.
    # Too few devices: the advice is this command's flag, not the library call.
    few = _trainer(
        f'--model={MODEL}', f'--logdir={tmp_path}', '--num_logical_cpus=2', '--max_steps=1'
    )
    assert few.returncode == 1 and '--num_logical_cpus=4' in few.stderr, few.stderr[-2000:]
    assert 'cluster.logical_cpus' not in few.stderr
    no_dev = _trainer(
        '--model=image.synthetic.AmoebaNetTiny',
        f'--logdir={tmp_path}/img',
        '--job=evaler_dev',
        '--num_logical_cpus=4',
    )
    assert no_dev.returncode == 1 and 'has no dev input' in no_dev.stderr, no_dev.stderr[-2000:]
    assert 'Traceback' not in no_dev.stderr
    negative = _trainer(f'--model={MODEL}', '--mode=inspect_model', '--num_logical_cpus=-1')
    assert negative.returncode == 1 and '--num_logical_cpus must be >= 1, got -1' in (
        negative.stderr
    )
    assert 'Traceback' not in negative.stderr
    # --tpu reaches the resolver; with no TPU here, a clear exit (TPUStrategy path: test_cluster).
    tpu = _trainer(f'--model={MODEL}', f'--logdir={tmp_path}', '--tpu=local')
    assert tpu.returncode == 1 and "No TPU answered for tpu='local'" in tpu.stderr, tpu.stderr
    assert 'Run on a TPU VM with --tpu=local' in tpu.stderr and 'Traceback' not in tpu.stderr
    # A second trainer on a logdir in use stops at once, naming the holder (here: this test).
    from tf_gpipe.trainer.logdir_lock import LogdirLock

    with LogdirLock(str(tmp_path)):
        busy = _trainer(
            f'--model={MODEL}', f'--logdir={tmp_path}', '--num_logical_cpus=4', '--max_steps=1'
        )
    assert busy.returncode == 1 and f'in use by another trainer (pid {os.getpid()}' in busy.stderr
    assert 'Traceback' not in busy.stderr and not os.path.exists(
        tmp_path / 'checkpoints' / 'checkpoint'
    )


def test_missing_worker_is_named_after_a_bounded_wait_and_ctrl_c_works(tmp_path):
    import signal
    import time

    from tf_gpipe.runtime import local_cluster

    ports = local_cluster.free_ports(2)
    spec = f'--cluster_spec=worker=127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}'
    start = time.monotonic()
    run = _trainer(f'--model={MODEL}', f'--logdir={tmp_path}', spec, '--connect_timeout=2')
    assert run.returncode == 1, run.stderr[-2000:]
    assert (
        f'2 task(s) did not answer within 2 s: worker 0 (127.0.0.1:{ports[0]}), worker 1 '
        f'(127.0.0.1:{ports[1]}). Start each with `tf_gpipe_worker'
    ) in run.stderr
    assert time.monotonic() - start < 60 and 'Traceback' not in run.stderr
    # Ctrl-C while waiting for the workers ends the run at once.
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, 'tools', 'trainer.py'), f'--model={MODEL}',
         f'--logdir={tmp_path}', spec, '--connect_timeout=300'],
        stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'),
    )  # fmt: skip
    for line in proc.stderr:
        if 'Waiting for worker 0' in line:
            break
    proc.send_signal(signal.SIGINT)
    stopped = time.monotonic()
    assert proc.wait(timeout=60) == 1
    assert time.monotonic() - stopped < 10
    assert 'interrupted while waiting for the cluster' in proc.stderr.read()


def test_train_on_worker_processes_with_cluster_spec_and_tf_config(tmp_path):
    """Stage k on TF worker k (loopback): --cluster_spec for training, TF_CONFIG for eval."""
    import json

    from tf_gpipe.runtime import local_cluster

    logdir = str(tmp_path / 'lm')
    two = 'task.pipeline.num_partitions=2; task.pipeline.num_micro_batches=2'
    with local_cluster.LocalCluster(2) as workers:
        hosts = workers.spec['worker']
        run = _trainer(
            f'--model={MODEL}',
            f'--logdir={logdir}',
            '--max_steps=20',
            f'--cluster_spec=worker={",".join(hosts)}',
            f'--params_override={two}',
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert 'DeviceMesh [1 replicas x 2 stages]' in run.stderr
        assert '/job:worker/replica:0/task:1/device:CPU:0' in run.stderr
        losses = _scalars(f'{logdir}/train', 'loss')
        assert losses[-1][0] == 20 and losses[-1][1] < losses[0][1]
        env = dict(
            os.environ,
            TF_CPP_MIN_LOG_LEVEL='3',
            TF_CONFIG=json.dumps({'cluster': {'worker': hosts}}),
        )
        ev = subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, 'tools', 'trainer.py'),
                f'--model={MODEL}',
                f'--logdir={logdir}',
                '--mode=eval',
                f'--params_override={two}',
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=ROOT,
        )
        assert ev.returncode == 0, ev.stderr[-3000:]
        assert _scalars(f'{logdir}/eval', 'accuracy')[0][0] == 20


@pytest.mark.parametrize(
    'key', ['lm.synthetic.TransformerLmTiny', 'mt.synthetic.TransformerNmtTiny']
)
def test_a_training_step_computes_on_the_stages_only(tmp_path, key):
    # On a TF cluster an unplaced op runs on the client: apart from the input (made on the
    # host), no tensor of the step may be computed there, and each update runs on its
    # variable's device.
    from tests.placement_testing import bulk_unplaced, misplaced_updates
    from tf_gpipe import model_registry
    from tf_gpipe.trainer import trainer

    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    model = model_registry.GetClass(key)()
    t = trainer.Trainer(
        trainer.ModelParams(model.Task(), model.Train(), model.Test()), str(tmp_path)
    )
    t.Build()
    graph = t._train_step.get_concrete_function().graph
    assert [op for op in bulk_unplaced(graph) if ':input/' not in op] == []
    assert misplaced_updates(graph) == []


def test_lingvo_tree_and_the_old_names():
    """input.* is the training input, task.train.* the loop and learner, task.eval.* the
    evaluation; the earlier names still work, each with a deprecation warning."""
    from tf_gpipe import hyperparams, model_registry
    from tf_gpipe.trainer import trainer

    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    model = model_registry.GetClass(MODEL)()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    text = p.ToText()
    for name in ('input.batch_size', 'task.train.max_steps', 'task.train.learner.optimizer',
                 'task.eval.steps', 'task.eval.interval_steps'):  # fmt: skip
        assert f'{name} :' in text
    for old in ('train.batch_size', 'task.learner.', 'eval_steps', 'eval_interval_steps'):
        assert old not in text
    hyperparams.apply_overrides(
        p,
        'train.batch_size=8; train.max_steps=100; task.learner.learning_rate=0.5; '
        'task.train.eval_steps=3; task.train.eval_interval_steps=30',
    )
    assert p.input.batch_size == 8 and p.task.train.max_steps == 100
    assert p.task.train.learner.learning_rate == 0.5
    assert (p.task.eval.steps, p.task.eval.interval_steps) == (3, 30)
    run = _trainer(
        f'--model={MODEL}', '--mode=inspect_params', '--params_override=train.max_steps=100'
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert 'task.train.max_steps : 100' in run.stdout
    assert "Parameter 'train.max_steps' is deprecated; use 'task.train.max_steps'" in run.stderr
