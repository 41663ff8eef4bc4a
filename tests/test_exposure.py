"""exposure: a TF server we start on a loopback cluster still listens on every interface (TF
binds 0.0.0.0; pinned here, so an upgrade that honours the host fails loudly and docs/reliability.md's
Security section gets revised), and the worker says so in one line; a socket bound to loopback
only is not reported."""

import json
import os
import socket
import subprocess
import sys

from tf_gpipe.runtime import cluster_spec, exposure
from tf_gpipe.runtime.local_cluster import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_loopback_only_socket_is_not_reported():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        s.listen()
        port = s.getsockname()[1]
        assert exposure.reachable_at(port, ['127.0.0.1']) == ['127.0.0.1']  # it does answer
        assert exposure.reachable_at(port) == []  # but nowhere else
        assert exposure.warning(f'127.0.0.1:{port}') is None


def test_a_loopback_tf_worker_is_reachable_beyond_loopback_and_warns():
    port = free_ports(1)[0]
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL='3',
        PYTHONPATH=ROOT,
        TF_GPIPE_EXIT_WITH_PARENT=str(os.getpid()),
        TF_CONFIG=json.dumps(
            {'cluster': {'worker': [f'127.0.0.1:{port}']}, 'task': {'type': 'worker', 'index': 0}}
        ),
    )
    worker = subprocess.Popen(
        [sys.executable, '-m', 'tf_gpipe.runtime.worker'],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        ready = worker.stdout.readline()  # after the server started and the check ran
        assert ready.startswith('ready: worker 0'), ready
        external = exposure.external_addresses()
        reached = exposure.reachable_at(port)
        # cluster_spec.wait_for's protocol check knows a real TF worker (a stranger: there).
        assert cluster_spec.is_tf_server(f'127.0.0.1:{port}', 30.0)
    finally:
        worker.kill()
        _, err = worker.communicate(timeout=300)
    assert external, 'this test needs a machine with a non-loopback address'
    # The cluster spec says 127.0.0.1, TF listens everywhere: every address of the machine.
    assert reached == external, (reached, external)
    lines = [line for line in err.splitlines() if 'SECURITY:' in line]
    assert len(lines) == 1 and f'{external[0]}' in lines[0] and 'Firewall' in lines[0], err
