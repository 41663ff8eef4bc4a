"""Trains, evaluates or inspects a registered model.

    python tools/trainer.py --model=lm.synthetic.TransformerLmTiny --logdir=runs/lm \
        --num_logical_cpus=4 --params_override='task.pipeline.num_micro_batches=16'

Modes: train | eval | train_and_eval | inspect_params | inspect_model | inspect_checkpoint
(--checkpoint=<prefix or directory>, or the latest in --logdir). Checkpoints go to
<logdir>/checkpoints (a restart resumes from the latest), TensorBoard summaries to
<logdir>/train and <logdir>/eval.
"""

import os
import re
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from absl import app, flags, logging  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)

from tf_gpipe import cluster, hyperparams, model_registry  # noqa: E402

MODES = ('train', 'eval', 'train_and_eval', 'inspect_params', 'inspect_model', 'inspect_checkpoint')
MODEL = flags.DEFINE_string(
    'model', None, 'Registered model key, e.g. lm.synthetic.TransformerLmTiny.'
)
LOGDIR = flags.DEFINE_string('logdir', None, 'Directory for checkpoints and summaries.')
MODE = flags.DEFINE_enum('mode', 'train', MODES, 'What to do.')
OVERRIDE = flags.DEFINE_string(
    'params_override', '', "e.g. 'task.pipeline.num_micro_batches=16; train.batch_size=32'."
)
PARAMS_DIR = flags.DEFINE_string(
    'params_dir', None, 'Extra directory of params/<task>/<file>.py files.'
)
CHECKPOINT = flags.DEFINE_string(
    'checkpoint', None, 'inspect_checkpoint: a checkpoint prefix or directory (default: --logdir).'
)
MAX_STEPS = flags.DEFINE_integer('max_steps', None, 'Overrides task.train.max_steps.')
CPUS = flags.DEFINE_integer('num_logical_cpus', None, 'Split the CPU into this many devices.')
TPU = flags.DEFINE_string('tpu', None, 'TPU name or address (cells on TPU cores; untested here).')
CLUSTER_SPEC = flags.DEFINE_string(
    'cluster_spec', None, "'worker=h0:2222,h1:2222' (or TF_CONFIG); stage k on worker k."
)


def _model_params():
    from tf_gpipe.trainer import trainer

    for candidate in (os.path.join(ROOT, 'params'), os.path.join(os.getcwd(), 'params')):
        if os.path.isdir(candidate):  # the checkout's params (absent for an installed script)
            model_registry.LoadParamsDir(candidate)
    if PARAMS_DIR.value:
        model_registry.LoadParamsDir(PARAMS_DIR.value)
    model = model_registry.GetClass(MODEL.value)()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    hyperparams.apply_overrides(p, OVERRIDE.value)
    if MAX_STEPS.value is not None:
        p.task.train.max_steps = MAX_STEPS.value
    return p


def _connect():
    """Joins a TF cluster (--cluster_spec, TF_CONFIG or --tpu) so its devices are usable."""
    import json

    import tensorflow as tf

    if TPU.value:
        mesh = cluster.DeviceMesh.from_tpu(cluster.tpu_device_assignment(1))
        return cluster.use_mesh(mesh)
    spec = None
    if CLUSTER_SPEC.value:
        spec = _parse_cluster_spec(CLUSTER_SPEC.value)
    elif 'TF_CONFIG' in os.environ:
        try:
            spec = json.loads(os.environ['TF_CONFIG'])['cluster']
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f'TF_CONFIG has no readable cluster ({type(e).__name__}: {e}). Expected e.g. '
                '{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}}.'
            ) from None
    if spec is None:
        return None
    if 'client' not in spec:  # this process joins as the client, on a free local port
        from tf_gpipe import local_cluster

        spec['client'] = [f'127.0.0.1:{local_cluster.free_ports(1)[0]}']
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(spec), job_name='client')
    mesh = cluster.DeviceMesh.from_cluster(spec)
    logging.info('Connected to the cluster; %s', mesh)
    return cluster.use_mesh(mesh)


_EXAMPLE_SPEC = "--cluster_spec='worker=127.0.0.1:2222,127.0.0.1:2223'"


def _parse_cluster_spec(text):
    """{job: [host:port, ...]} from 'job=h:p,h:p;job2=...'; a malformed one says how it
    should look."""
    spec = {}
    for job in filter(None, (j.strip() for j in text.split(';'))):
        name, sep, hosts = job.partition('=')
        addresses = [h.strip() for h in hosts.split(',') if h.strip()]
        bad = [a for a in addresses if not re.fullmatch(r'[\w.\-\[\]:]+:\d+', a)]
        if not sep or not name.strip() or not addresses or bad:
            why = (
                f'{bad[0]!r} is not host:port' if bad else f'{job!r} is not job=host:port,host:port'
            )
            raise ValueError(
                f'--cluster_spec={text!r} is malformed: {why}. Expected e.g. {_EXAMPLE_SPEC} '
                "(jobs separated by ';')."
            )
        spec[name.strip()] = addresses
    if not spec:
        raise ValueError(f'--cluster_spec={text!r} names no job. Expected e.g. {_EXAMPLE_SPEC}.')
    return spec


def _for_this_command(error):
    """The library's advice in this command's terms: `cluster.logical_cpus(8)` (a call to make
    before TF initialises) is the flag --num_logical_cpus=8 here."""
    return re.sub(
        r'cluster\.logical_cpus\((\d+)\)(?: before (?:TF initialises|anything else touches TF))?',
        r'--num_logical_cpus=\1',
        str(error),
    )


def main(argv):
    del argv
    if MODE.value == 'inspect_checkpoint':
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
    if CPUS.value:
        cluster.logical_cpus(CPUS.value)
    try:
        p = _model_params()
    except (LookupError, AttributeError, ValueError, FileNotFoundError) as e:
        sys.exit(f'trainer: {e}')  # a clear message and exit status 1, no traceback
    from tf_gpipe.trainer import trainer

    if MODE.value == 'inspect_params':
        print(p.ToText(), end='')
        return
    if MODE.value == 'inspect_model':
        try:
            table, _ = trainer.InspectModel(p.task, p.train)
        except ValueError as e:
            sys.exit(f'trainer: {_for_this_command(e)}')
        print(table)
        return
    if not LOGDIR.value:
        raise app.UsageError('--logdir is required for train and eval.')
    import tensorflow as tf

    try:
        mesh_scope = _connect()
        t = trainer.Trainer(p, LOGDIR.value)
        if mesh_scope is not None:
            with mesh_scope:
                t.Build()
        if MODE.value == 'eval':
            t.Evaluate()
        else:
            last = t.Train(eval_too=MODE.value == 'train_and_eval')
            logging.info('Done: %s', last)
    except (RuntimeError, FloatingPointError, ValueError) as e:
        # Diverged, bad params, bad logdir, too few devices, unreadable or foreign checkpoint.
        sys.exit(f'trainer: {_for_this_command(e)}')
    except tf.errors.UnavailableError as e:
        sys.exit(
            f'trainer: a TF worker is unreachable ({str(e).splitlines()[0][:300]}). Restart it '
            'and run the same command: training resumes from the last checkpoint.'
        )


if __name__ == '__main__':
    app.run(main)
