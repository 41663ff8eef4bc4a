"""Starts one TF worker of a tf_gpipe cluster and serves until killed.

    python tools/worker.py --cluster_spec='worker=h0:2222,h1:2222' --task_index=1
    tf_gpipe_worker --task_index=1            # the cluster from TF_CONFIG

Start one per task of the trainer's --cluster_spec (or TF_CONFIG), then the trainer.
"""

import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from absl import app, flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(ROOT, 'tf_gpipe')) and ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run from a checkout without installing

from tf_gpipe.runtime import cluster_spec  # noqa: E402

CLUSTER_SPEC = flags.DEFINE_string(
    'cluster_spec', None, f"'{cluster_spec.EXAMPLE}' (default: TF_CONFIG's cluster)."
)
JOB = flags.DEFINE_string('job_name', None, "This task's job (default: TF_CONFIG's, or 'worker').")
TASK = flags.DEFINE_integer('task_index', None, "This task's index (default: TF_CONFIG's).")


def main(argv):
    del argv
    from tf_gpipe.runtime import worker

    try:
        spec, task = cluster_spec.from_tf_config()
        if CLUSTER_SPEC.value:
            spec = cluster_spec.parse(CLUSTER_SPEC.value)
        if spec is None:
            raise ValueError(
                f"no cluster: pass --cluster_spec='{cluster_spec.EXAMPLE}' or set TF_CONFIG."
            )
        task = task or {}
        index = TASK.value if TASK.value is not None else task.get('index')
        if index is None:
            raise ValueError('which task is this? Pass --task_index=i.')
        job = JOB.value or task.get('type', 'worker')
        worker.Serve(spec, job, int(index))
    except ValueError as e:
        sys.exit(f'tf_gpipe_worker: {e}')


if __name__ == '__main__':
    app.run(main)
