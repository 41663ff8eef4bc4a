"""Start TF worker processes on 127.0.0.1 (tests, benchmarks, single-host multi-process runs).

Each worker is a `tf.distribute.Server` in its own Python process, optionally pinned to one core
(`taskset -c`, one intra-op thread) so that "one worker per stage" means one core per stage. The
client connects with `tf.config.experimental_connect_to_cluster`, and TF's own distributed
runtime carries the tensors between stages — no transport of ours.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import tensorflow as tf
from absl import logging

from tf_gpipe.runtime import exposure


def free_ports(n):
    """n distinct free TCP ports on 127.0.0.1."""
    sockets, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(('127.0.0.1', 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


class LocalCluster:
    """`num_workers` TF workers on loopback, plus a 'client' task for this process.

    Use as a context manager; workers are always killed on exit. `cores` pins worker i to core
    cores[i] (with one intra-op and two inter-op threads) when `taskset` exists; `env` adds to
    the workers' environment (e.g. TF_CPU_BFC_MEM_LIMIT_IN_MB, a per-worker memory budget).
    """

    def __init__(self, num_workers, cores=None, job_name='worker', start_timeout=180.0, env=None):
        if num_workers < 1:
            raise ValueError(f'num_workers must be >= 1, got {num_workers}.')
        self.num_workers = num_workers
        self.job_name = job_name
        ports = free_ports(num_workers + 1)
        self.spec = {
            job_name: [f'127.0.0.1:{p}' for p in ports[:num_workers]],
            'client': [f'127.0.0.1:{ports[-1]}'],
        }
        self._cores = cores
        self._env = dict(env or {})  # extra environment of the workers (e.g. a memory budget)
        self._timeout = start_timeout
        self.processes = []

    @property
    def cluster_spec(self):
        return tf.train.ClusterSpec(self.spec)

    def device(self, task, kind='CPU', index=0):
        return f'/job:{self.job_name}/replica:0/task:{task}/device:{kind}:{index}'

    def devices(self):
        return [self.device(i) for i in range(self.num_workers)]

    def start(self):
        if any(proc.poll() is None for proc in self.processes):
            # A second set of workers would find the ports taken and never report ready.
            raise RuntimeError(
                'This LocalCluster is already started: use `with LocalCluster(...)` or '
                'start(), not both (stop() it first to start it again).'
            )
        env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', **self._env}
        for i in range(self.num_workers):
            cmd = [sys.executable, '-m', 'tf_gpipe.runtime.worker']
            task = {'type': self.job_name, 'index': i}
            worker_env = dict(env, TF_CONFIG=json.dumps({'cluster': self.spec, 'task': task}))
            # tf_gpipe importable in the worker even when it is not installed (a checkout).
            package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            path = [package_root] + [p for p in [env.get('PYTHONPATH')] if p]
            worker_env['PYTHONPATH'] = os.pathsep.join(path)
            worker_env['TF_GPIPE_EXIT_WITH_PARENT'] = str(os.getpid())  # no orphans
            if self._cores is not None:
                # One core and one compute thread; a second inter-op thread lets a finished
                # micro-batch's Send run while the next micro-batch computes (with one, the
                # Send waits for the whole forward wave: measured, no overlap at all).
                worker_env.update(TF_NUM_INTRAOP_THREADS='1', TF_NUM_INTEROP_THREADS='2')
                if shutil.which('taskset'):
                    cmd = ['taskset', '-c', str(self._cores[i])] + cmd
            self.processes.append(
                subprocess.Popen(
                    cmd,
                    env=worker_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
        deadline = time.time() + self._timeout
        for i, proc in enumerate(self.processes):
            line = ''
            while time.time() < deadline and proc.poll() is None:
                line = proc.stdout.readline()
                if line.startswith('ready'):
                    break
            if not line.startswith('ready'):
                self.stop()
                raise RuntimeError(f'TF worker {i} did not start within {self._timeout:.0f}s.')
        return self

    def connect(self):
        """Makes this process the cluster's client (devices of every worker become usable)."""
        tf.config.experimental_connect_to_cluster(self.cluster_spec, job_name='client')
        exposed = exposure.warning(self.spec['client'][0], 'the TF client')
        if exposed:
            logging.warning('%s', exposed)
        return self

    def kill(self, task):
        """Kills worker `task` (SIGKILL), as a crash would."""
        self.processes[task].kill()
        self.processes[task].wait()

    def memory_peaks(self, timeout=30.0):
        """Stops every worker and returns each one's peak allocator bytes (the workers must run
        with env TF_CPU_ALLOCATOR_USE_BFC=true and TF_GPIPE_MEMORY_REPORT=1)."""
        for proc in self.processes:
            proc.terminate()
        peaks = []
        for i, proc in enumerate(self.processes):
            out, _ = proc.communicate(timeout=timeout)
            lines = [x for x in out.splitlines() if x.startswith('memory:')]
            if not lines:
                raise RuntimeError(
                    f'TF worker {i} reported no memory: start the cluster with env '
                    'TF_CPU_ALLOCATOR_USE_BFC=true and TF_GPIPE_MEMORY_REPORT=1.'
                )
            peaks.append(int(lines[-1].split('peak=')[1]))
        self.processes = []
        return peaks

    def stop(self):
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
        for proc in self.processes:
            proc.wait()
        self.processes = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False
