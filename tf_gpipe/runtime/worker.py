"""A TF worker process: a `tf.distribute.Server` for one task of a cluster, serving until killed.

    TF_CONFIG='{"cluster": {"worker": ["h0:2222", "h1:2222"]},
                "task": {"type": "worker", "index": 1}}' python -m tf_gpipe.runtime.worker

`tf_gpipe_worker --cluster_spec=... --task_index=1` (tools/worker.py) does the same from flags.
Everything it runs arrives from the trainer (the cluster's client) over TF's own runtime.
"""

import os
import sys
import threading
import time

import tensorflow as tf

from tf_gpipe.runtime import cluster_spec, exposure

# Set to the client's pid (LocalCluster does): the worker exits when that process is gone.
EXIT_WITH_PARENT = 'TF_GPIPE_EXIT_WITH_PARENT'
# Set (with TF_CPU_ALLOCATOR_USE_BFC=true): on SIGTERM the worker prints its CPU allocator's
# current and peak bytes ('memory: current=N peak=N') and exits — the planner's check reads
# each stage's peak this way, as a client cannot ask a remote allocator.
MEMORY_REPORT = 'TF_GPIPE_MEMORY_REPORT'


def _report_memory_on_sigterm():
    import signal

    def report(*_):
        info = tf.config.experimental.get_memory_info('CPU:0')
        print(f'memory: current={info["current"]} peak={info["peak"]}', flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, report)


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
    exposed = exposure.warning(spec[job_name][task_index], f'TF worker {job_name} {task_index}')
    if exposed:
        print(f'tf_gpipe.worker: {exposed}', file=sys.stderr, flush=True)
    print(
        f'ready: {job_name} {task_index} at {spec[job_name][task_index]} '
        f'(pid {os.getpid()}); serving until killed',
        flush=True,
    )
    if wait and os.environ.get(MEMORY_REPORT):
        while True:  # Python's signal handlers run only between bytecodes, never in join()
            time.sleep(0.2)
    if wait:
        server.join()
    return server


def _exit_with_parent(parent_pid, poll=1.0):
    """A worker started for one client (LocalCluster) ends when that client does, even if it
    was killed: an orphan's parent becomes another process."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(poll)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _main():
    if os.environ.get(EXIT_WITH_PARENT):
        _exit_with_parent(int(os.environ[EXIT_WITH_PARENT]))
    if os.environ.get(MEMORY_REPORT):
        _report_memory_on_sigterm()
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
