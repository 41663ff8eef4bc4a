"""A TF worker process: a `tf.distribute.Server` for one task of a cluster, serving until killed.

    TF_CONFIG='{"cluster": {"worker": ["h0:2222", "h1:2222"]},
                "task": {"type": "worker", "index": 1}}' python -m tf_gpipe.worker

`tf_gpipe_worker --cluster_spec=... --task_index=1` (tools/worker.py) does the same from flags.
Everything it runs arrives from the trainer (the cluster's client) over TF's own runtime.
"""

import os
import sys

import tensorflow as tf

from tf_gpipe import cluster_spec


def Serve(spec, job_name, task_index, wait=True):
    """Starts task `job_name`:`task_index` of `spec` ({job: [host:port]}); prints a 'ready'
    line, then serves forever (wait=True) or returns the server."""
    if job_name not in spec:
        raise ValueError(
            f'The cluster has no job {job_name!r} (jobs: {", ".join(spec)}); pass the job name.'
        )
    count = len(spec[job_name])
    if not 0 <= task_index < count:
        raise ValueError(
            f'task index {task_index} is not in job {job_name!r}, which has {count} task(s) '
            f'(0 .. {count - 1}).'
        )
    server = tf.distribute.Server(
        tf.train.ClusterSpec(spec), job_name=job_name, task_index=task_index, protocol='grpc'
    )
    print(
        f'ready: {job_name} {task_index} at {spec[job_name][task_index]} '
        f'(pid {os.getpid()}); serving until killed',
        flush=True,
    )
    if wait:
        server.join()
    return server


def _main():
    spec, task = cluster_spec.from_tf_config()
    if spec is None or not task:
        sys.exit(
            'tf_gpipe.worker: set TF_CONFIG with "cluster" and "task" ({"type": "worker", '
            '"index": i}), or use tf_gpipe_worker --cluster_spec=... --task_index=i.'
        )
    try:
        Serve(spec, task.get('type', 'worker'), int(task.get('index', 0)))
    except ValueError as e:
        sys.exit(f'tf_gpipe.worker: {e}')


if __name__ == '__main__':
    _main()
