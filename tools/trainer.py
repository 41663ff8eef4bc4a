"""Trains, evaluates or inspects a registered model.

    python tools/trainer.py --model=lm.synthetic.TransformerLmTiny --logdir=runs/lm \
        --num_logical_cpus=4 --params_override='task.pipeline.num_micro_batches=16'

Modes: train | eval | train_and_eval | export (--export_dir=DIR: a SavedModel of the newest
checkpoint, one device, any batch size) | inspect_params | inspect_model | inspect_checkpoint
(--checkpoint=<prefix or directory>, or the latest in --logdir). Checkpoints go to
<logdir>/checkpoints (a restart resumes from the latest), TensorBoard summaries to
<logdir>/train and <logdir>/eval.
"""

import os
import re
import signal
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from absl import app, flags, logging  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)

from tf_gpipe import hyperparams, model_registry  # noqa: E402
from tf_gpipe.runtime import cluster, cluster_spec, exposure  # noqa: E402

MODES = (
    'train',
    'eval',
    'train_and_eval',
    'evaler',
    'decode',
    'decoder',
    'export',
    'inspect_params',
    'inspect_model',
    'inspect_checkpoint',
)
MODEL = flags.DEFINE_string(
    'model', None, 'Registered model key, e.g. lm.synthetic.TransformerLmTiny.'
)
LOGDIR = flags.DEFINE_string('logdir', None, 'Directory for checkpoints and summaries.')
MODE = flags.DEFINE_enum('mode', 'train', MODES, 'What to do.')
OVERRIDE = flags.DEFINE_string(
    'params_override', '', "e.g. 'task.pipeline.num_micro_batches=16; input.batch_size=32'."
)
PARAMS_DIR = flags.DEFINE_string(
    'params_dir', None, 'Extra directory of params/<task>/<file>.py files.'
)
CHECKPOINT = flags.DEFINE_string(
    'checkpoint', None, 'inspect_checkpoint: a checkpoint prefix or directory (default: --logdir).'
)
MAX_STEPS = flags.DEFINE_integer('max_steps', None, 'Overrides task.train.max_steps.')
EXPORT_DIR = flags.DEFINE_string(
    'export_dir',
    None,
    "export: where the SavedModel of --logdir's newest checkpoint goes (one device, any batch "
    "size; served without tf_gpipe: its 'serving_default' signature).",
)
CPUS = flags.DEFINE_integer('num_logical_cpus', None, 'Split the CPU into this many devices.')
TPU = flags.DEFINE_string(
    'tpu',
    None,
    "TPU to train on: 'local' on a TPU VM, else its name or grpc:// address. TPUStrategy, "
    'K = task.pipeline.num_partitions cores per replica, R = cores // K (not run on hardware).',
)
CLUSTER_SPEC = flags.DEFINE_string(
    'cluster_spec', None, "'worker=h0:2222,h1:2222' (or TF_CONFIG); stage k on worker k."
)
REPLICAS = flags.DEFINE_integer(
    'num_replicas',
    1,
    'R data-parallel replicas of the K-stage pipeline under a tf.distribute MirroredStrategy '
    "(mesh.strategy()) over this process's R x K devices; the batch is split across them.",
)
MULTI_WORKER = flags.DEFINE_bool(
    'multi_worker',
    False,
    'Every worker runs this same command (TF_CONFIG names its task): one data-parallel replica '
    'per worker, its K local devices as the stages, under a MultiWorkerMirroredStrategy. '
    'Without it, TF_CONFIG / --cluster_spec make this process the one client of remote workers.',
)
JOB = flags.DEFINE_enum(
    'job',
    None,
    ('trainer', 'evaler_test', 'evaler_dev', 'decoder_test'),
    "Lingvo's job names: trainer is --mode=train, evaler_test --mode=evaler, evaler_dev "
    "--mode=evaler on the params class's Dev() input, decoder_test --mode=decoder (the "
    'continuous ones poll the logdir until the final checkpoint).',
)
EVALER_TIMEOUT = flags.DEFINE_float(
    'evaler_timeout',
    3600.0,
    'evaler: seconds to wait for a new checkpoint before giving up (the trainer stopped?).',
)
EVALER_POLL = flags.DEFINE_float('evaler_poll_seconds', 5.0, 'evaler: seconds between polls.')
BEAM_SIZE = flags.DEFINE_integer('beam_size', 4, 'decode (translation): beams; 1 is greedy.')
LENGTH_ALPHA = flags.DEFINE_float(
    'length_alpha', 0.6, "decode: GNMT's length penalty ((5 + length) / 6) ** alpha."
)
DECODE_MAX_LEN = flags.DEFINE_integer(
    'decode_max_len', None, "decode: tokens per hypothesis (default: the test input's length)."
)
TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'decode (language model): sampling.')
TOP_K = flags.DEFINE_integer('top_k', 0, 'decode (language model): sample among the k best.')
CONNECT_TIMEOUT = flags.DEFINE_float(
    'connect_timeout', 120.0, 'Seconds to wait for every worker of the cluster to answer.'
)


def _model_params():
    from tf_gpipe.trainer import trainer

    for candidate in (os.path.join(ROOT, 'params'), os.path.join(os.getcwd(), 'params')):
        if os.path.isdir(candidate):  # the checkout's params (absent for an installed script)
            model_registry.LoadParamsDir(candidate)
    if PARAMS_DIR.value:
        model_registry.LoadParamsDir(PARAMS_DIR.value)
    for path, why in model_registry.BrokenFiles().items():
        logging.warning(
            'Params file %s could not be imported (%s); its models are missing.', path, why
        )
    model = model_registry.GetClass(MODEL.value)()
    p = trainer.ModelParams(
        *(model_registry.CallParams(model, m) for m in ('Task', 'Train', 'Test', 'Dev'))
    )
    hyperparams.apply_overrides(p, OVERRIDE.value)
    if MAX_STEPS.value is not None:
        p.task.train.max_steps = MAX_STEPS.value
    return p


def _connect():
    """Joins a TF cluster (--cluster_spec, TF_CONFIG or --tpu) so its devices are usable; first
    waits (bounded, Ctrl-C works) until every worker answers."""
    import tensorflow as tf

    if TPU.value:
        return _tpu_strategy_scope(), None
    if MULTI_WORKER.value:
        return _multi_worker_scope(), None
    if REPLICAS.value > 1:
        if CLUSTER_SPEC.value or os.environ.get('TF_CONFIG'):
            raise ValueError(
                "--num_replicas > 1 runs the replicas on this process's devices; with a TF "
                'cluster set task.pipeline.num_replicas (one client over the workers) instead.'
            )
        return _local_strategy_scope(REPLICAS.value), None
    if CLUSTER_SPEC.value:
        spec = cluster_spec.parse(CLUSTER_SPEC.value)
    else:
        spec, _ = cluster_spec.from_tf_config()
    if spec is None:
        return None, None
    spec = dict(spec)
    if 'client' not in spec:  # this process joins as the client, on a free local port
        from tf_gpipe.runtime import local_cluster

        spec['client'] = [f'127.0.0.1:{local_cluster.free_ports(1)[0]}']
    servers = [j for j in spec if j != 'client']
    cluster_spec.wait_for(spec, CONNECT_TIMEOUT.value, jobs=servers, log=logging.info)
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(spec), job_name='client')
    exposed = exposure.warning(spec['client'][0], "the trainer's TF client")
    if exposed:
        logging.warning('%s', exposed)
    mesh = cluster.DeviceMesh.from_cluster(spec)
    logging.info('Connected to the cluster; %s', mesh)
    return cluster.use_mesh(mesh), (spec, servers)


def _num_stages():
    """K of the model's pipeline (1 without one): each replica's devices."""
    p = _model_params()
    return p.task.pipeline.num_partitions if 'pipeline' in p.task else 1


def _local_strategy_scope(num_replicas):
    """mesh.strategy().scope() for R replicas x K stages of this process's devices."""
    stages = _num_stages()
    mesh = cluster.DeviceMesh.from_local(num_replicas=num_replicas, num_stages=stages)
    logging.info('Data parallel under %s: %s', type(mesh.strategy()).__name__, mesh)
    return mesh.strategy().scope()


def _tpu_strategy_scope():
    """TPUStrategy's scope over the TPU --tpu names: K cores per replica, R = cores // K."""
    stages = _num_stages()
    mesh = cluster.tpu_mesh(stages, tpu=TPU.value)
    logging.info('TPUStrategy, %d replicas x %d cores: %s', mesh.num_replicas, stages, mesh)
    return mesh.strategy().scope()


def _multi_worker_scope():
    """MultiWorkerMirroredStrategy's scope over TF_CONFIG's workers, K local devices each."""
    spec, task = cluster_spec.from_tf_config()
    if spec is None or not task or task.get('type') != 'worker':
        raise ValueError(
            "--multi_worker needs TF_CONFIG naming the cluster and this process's task, e.g. "
            '{"cluster": {"worker": ["h0:2222", "h1:2222"]}, "task": {"type": "worker", '
            '"index": 0}}, and the same command on every worker.'
        )
    stages = _num_stages()
    mesh = cluster.DeviceMesh.from_cluster(
        spec, num_replicas=len(spec['worker']), num_stages=stages, devices_per_task=stages
    )
    logging.info('Worker %d of %d under MultiWorkerMirroredStrategy: %s', task['index'],
                 len(spec['worker']), mesh)  # fmt: skip
    return mesh.strategy().scope()


def _logdir():
    """--logdir; under --multi_worker, worker i > 0 keeps its own copy in <logdir>/worker_i
    (every worker takes part in saving; all restore from the chief's, the same step)."""
    if not MULTI_WORKER.value:
        return LOGDIR.value
    _, task = cluster_spec.from_tf_config()
    index = int(task.get('index', 0))
    return LOGDIR.value if index == 0 else os.path.join(LOGDIR.value, f'worker_{index}')


def _for_this_command(error):
    """The library's advice in this command's terms: `cluster.logical_cpus(8)` (a call to make
    before TF initialises) is the flag --num_logical_cpus=8 here."""
    return re.sub(
        r'cluster\.logical_cpus\((\d+)\)(?: before (?:TF initialises|anything else touches TF))?',
        r'--num_logical_cpus=\1',
        str(error),
    )


def _mode():
    jobs = {
        'trainer': 'train',
        'evaler_test': 'evaler',
        'evaler_dev': 'evaler',
        'decoder_test': 'decoder',
    }
    return jobs[JOB.value] if JOB.value else MODE.value


def main(argv):
    del argv
    mode = _mode()
    if mode == 'inspect_checkpoint':
        from tf_gpipe.trainer import checkpoints

        where = CHECKPOINT.value or LOGDIR.value
        if not where:
            raise app.UsageError('inspect_checkpoint needs --checkpoint or --logdir.')
        try:
            print(checkpoints.InspectText(where))
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f'trainer: {e}')
        return
    if not MODEL.value:
        raise app.UsageError('--model is required (e.g. lm.synthetic.TransformerLmTiny).')
    if CPUS.value is not None:
        if CPUS.value < 1:
            raise app.UsageError(f'--num_logical_cpus must be >= 1, got {CPUS.value}.')
        cluster.logical_cpus(CPUS.value)
    try:
        p = _model_params()
    except (LookupError, AttributeError, ValueError, FileNotFoundError) as e:
        sys.exit(f'trainer: {e}')  # a clear message and exit status 1, no traceback
    from tf_gpipe.trainer import trainer

    if mode == 'inspect_params':
        print(p.ToText(), end='')
        return
    if mode == 'inspect_model':
        try:
            table, _ = trainer.InspectModel(p.task, p.input)
        except ValueError as e:
            sys.exit(f'trainer: {_for_this_command(e)}')
        print(table)
        return
    if not LOGDIR.value:
        raise app.UsageError('--logdir is required for train, eval and export.')
    if mode == 'export':
        from tf_gpipe.trainer import export

        if not EXPORT_DIR.value:
            raise app.UsageError('export needs --export_dir (a new directory).')
        try:
            path = export.Export(p, LOGDIR.value, EXPORT_DIR.value)
        except (FileNotFoundError, FileExistsError, ValueError, RuntimeError) as e:
            sys.exit(f'trainer: {e}')
        print(f'Exported {path} to {EXPORT_DIR.value}.')
        return
    import tensorflow as tf

    joined = None
    try:
        # Ctrl-C interrupts the wait even when the shell started us with SIGINT ignored (as
        # it does for background jobs); training then handles SIGINT itself (a graceful stop).
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            mesh_scope, joined = _connect()
        except KeyboardInterrupt:
            sys.exit('trainer: interrupted while waiting for the cluster; nothing was started.')
        finally:
            signal.signal(signal.SIGINT, previous)
        t = trainer.Trainer(p, _logdir(), restore_from=LOGDIR.value)
        if mesh_scope is not None:
            with mesh_scope:
                t.Build()
        if mode == 'eval':
            t.Evaluate()
        elif mode == 'decode':
            from tf_gpipe.trainer import decoder

            decoder.run(
                t,
                BEAM_SIZE.value,
                LENGTH_ALPHA.value,
                DECODE_MAX_LEN.value,
                TEMPERATURE.value,
                TOP_K.value,
            )
        elif mode in ('evaler', 'decoder'):
            from tf_gpipe.trainer import decoder, evaler, logdir_lock

            job, evaluate = 'eval_test', None
            if JOB.value == 'evaler_dev':
                job = 'eval_dev'

                def evaluate(path, writer):
                    return t.EvaluateCheckpoint(path, writer, 'dev')

                t.Build()
                if t.dev_input is None:  # said before any waiting
                    sys.exit(
                        f'trainer: {MODEL.value} has no dev input (its params class defines no '
                        'Dev()); run --job=evaler_test.'
                    )
            if mode == 'decoder':

                def evaluate(path, writer):
                    return decoder.decode_checkpoint(
                        t, path, writer, BEAM_SIZE.value, LENGTH_ALPHA.value,
                        DECODE_MAX_LEN.value, TEMPERATURE.value, TOP_K.value,
                    )  # fmt: skip

                job = decoder.JOB
            os.makedirs(evaler.job_dir(LOGDIR.value, job), exist_ok=True)
            try:
                with logdir_lock.LogdirLock(evaler.job_dir(LOGDIR.value, job), what=mode):
                    evaler.run(t, EVALER_POLL.value, EVALER_TIMEOUT.value, job, evaluate)
            except KeyboardInterrupt:
                sys.exit(f'trainer: {mode} interrupted; rerun it to go on where it stopped.')
        else:
            last = t.Train(eval_too=mode == 'train_and_eval')
            logging.info('Done: %s', last)
    except (RuntimeError, FloatingPointError, ValueError, TimeoutError) as e:
        # Diverged, bad params, bad logdir, too few devices, unreadable or foreign checkpoint,
        # workers that never answered.
        sys.exit(f'trainer: {_for_this_command(e)}')
    except tf.errors.UnavailableError as e:
        gone = cluster_spec.gone(joined[0], joined[1]) if joined else []
        who = (
            f'{cluster_spec.describe(gone)} stopped answering'
            if gone
            else 'a TF worker is unreachable'
        )
        sys.exit(
            f'trainer: {who} ({str(e).splitlines()[0][:300]}). Restart it and run the same '
            'command: training resumes from the last checkpoint.'
        )


if __name__ == '__main__':
    app.run(main)
