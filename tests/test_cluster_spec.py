"""Cluster specs from text and TF_CONFIG, and bounded waits that name the silent tasks."""

import http.server
import json
import socket
import threading
import time

import pytest

from tf_gpipe.runtime import cluster_spec, local_cluster


def test_parse():
    assert cluster_spec.parse('worker=h0:2222,h1:2223; ps=h2:1') == {
        'worker': ['h0:2222', 'h1:2223'],
        'ps': ['h2:1'],
    }
    for text, why in (
        ('127.0.0.1:2222', 'is not job=host:port'),
        ('worker=h0', "'h0' is not host:port"),
        ('worker=', 'is not job=host:port'),
    ):
        with pytest.raises(ValueError, match=why + ".*Expected e.g. --cluster_spec='worker="):
            cluster_spec.parse(text)
    with pytest.raises(ValueError, match='names no job'):
        cluster_spec.parse(' ; ')


def test_from_tf_config():
    assert cluster_spec.from_tf_config({}) == (None, None)
    config = {'cluster': {'worker': ['h:1']}, 'task': {'type': 'worker', 'index': 0}}
    assert cluster_spec.from_tf_config({'TF_CONFIG': json.dumps(config)}) == (
        config['cluster'],
        config['task'],
    )
    for bad in ('{not json', '{"task": {}}', '{"cluster": ["h:1"]}'):
        with pytest.raises(ValueError, match='TF_CONFIG has no readable cluster.*Expected'):
            cluster_spec.from_tf_config({'TF_CONFIG': bad})


def test_unreachable_and_bounded_wait(monkeypatch):
    # Ports that accept connections stand in for TF servers here (the protocol check: below).
    monkeypatch.setattr(cluster_spec, 'is_tf_server', lambda address, timeout: True)
    listener = socket.socket()
    listener.bind(('127.0.0.1', 0))
    listener.listen()
    up = f'127.0.0.1:{listener.getsockname()[1]}'
    (free,) = local_cluster.free_ports(1)
    down = f'127.0.0.1:{free}'
    spec = {'worker': [up, down], 'client': ['127.0.0.1:1']}
    try:
        assert cluster_spec.unreachable(spec, ['worker']) == [('worker', 1, down)]
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=f'did not answer within 1 s: worker 1 \\({down}\\)'):
            cluster_spec.wait_for(spec, 1.0, jobs=['worker'], poll=0.1)
        assert time.monotonic() - start < 5
        # The silent task comes up while we wait: the wait returns.
        late = socket.socket()
        threading.Timer(0.5, lambda: (late.bind(('127.0.0.1', free)), late.listen())).start()
        logged = []
        cluster_spec.wait_for(spec, 10.0, jobs=['worker'], log=logged.append, poll=0.1)
        assert logged == [f'Waiting for worker 1 ({down}) (up to 10 s) ...']
        late.close()
    finally:
        listener.close()


def test_a_port_that_speaks_another_protocol_is_named_not_waited_on_forever():
    # An HTTP server where a worker should be accepted connections, and the trainer said
    # "Connected" and then hung at its first call: it is refused within the bound.
    server = http.server.HTTPServer(('127.0.0.1', 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f'127.0.0.1:{server.server_address[1]}'
    try:
        assert cluster_spec.unreachable({'worker': [address]}) == []  # the port answers
        assert not cluster_spec.is_tf_server(address, 2.0)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=rf'worker 0 \({address}\): the port accepts'):
            cluster_spec.wait_for({'worker': [address]}, 2.0, poll=0.1)
        assert time.monotonic() - start < 15
    finally:
        server.shutdown()
        server.server_close()
