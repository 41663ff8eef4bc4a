"""A worker from TF_CONFIG (`python -m tf_gpipe.runtime.worker`) or flags (`tools/worker.py`) serves its
task of the cluster; a task index outside the job is refused."""

import json
import os
import subprocess
import sys

import pytest

from tf_gpipe.runtime import cluster_spec, local_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(cmd, env):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', **env)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # blocks until 'ready' (or the process ends)
    return proc, line


@pytest.mark.parametrize('how', ['module', 'tool'])
def test_worker_serves_its_task(how):
    ports = local_cluster.free_ports(2)
    spec = {'worker': [f'127.0.0.1:{p}' for p in ports]}
    if how == 'module':
        config = {'cluster': spec, 'task': {'type': 'worker', 'index': 1}}
        cmd = [sys.executable, '-m', 'tf_gpipe.runtime.worker']
        env = {'TF_CONFIG': json.dumps(config)}
    else:
        cmd = [
            sys.executable,
            os.path.join(ROOT, 'tools', 'worker.py'),
            f'--cluster_spec=worker={",".join(spec["worker"])}',
            '--task_index=1',
        ]
        env = {}
    proc, line = _start(cmd, env)
    try:
        assert line.startswith(f'ready: worker 1 at {spec["worker"][1]}'), proc.stderr.read()
        assert cluster_spec.unreachable(spec) == [('worker', 0, spec['worker'][0])]
    finally:
        proc.kill()
        proc.wait()


def test_worker_refuses_a_task_outside_the_job():
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, 'tools', 'worker.py'),
            '--cluster_spec=worker=127.0.0.1:1,127.0.0.1:2',
            '--task_index=2',
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'),
    )
    assert proc.returncode == 1
    assert "task index 2 is not in job 'worker', which has 2 task(s) (0 .. 1)" in proc.stderr
    no_cluster = subprocess.run(
        [sys.executable, '-m', 'tf_gpipe.runtime.worker'],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != 'TF_CONFIG'},
    )
    assert no_cluster.returncode == 1 and 'set TF_CONFIG' in no_cluster.stderr


def test_workers_of_a_killed_client_do_not_outlive_it():
    """LocalCluster's workers exit when their client dies, even by SIGKILL (no orphans)."""
    import signal
    import time

    client = subprocess.Popen(
        [
            sys.executable,
            '-c',
            'import time\n'
            'from tf_gpipe import local_cluster\n'
            'c = local_cluster.LocalCluster(1).start()\n'
            'print(c.processes[0].pid, flush=True)\n'
            'time.sleep(600)\n',
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'),
    )
    worker_pid = int(client.stdout.readline())
    os.kill(client.pid, signal.SIGKILL)
    client.wait()
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.kill(worker_pid, 0)  # still there?
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(worker_pid, signal.SIGKILL)
        raise AssertionError('the worker outlived its killed client by 30 s')
