"""A TF cluster's spec from text or TF_CONFIG, and which of its tasks answer (bounded waits).

The trainer joins a cluster only once every worker answers, so a worker that is not up is an
error naming it after a bounded wait (not a silent hang inside TF's runtime, deaf to Ctrl-C),
and a worker that dies mid-run is named the same way.
"""

import json
import os
import re
import socket
import time

EXAMPLE = 'worker=127.0.0.1:2222,127.0.0.1:2223'


def parse(text):
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
                f'--cluster_spec={text!r} is malformed: {why}. Expected e.g. '
                f"--cluster_spec='{EXAMPLE}' (jobs separated by ';')."
            )
        spec[name.strip()] = addresses
    if not spec:
        raise ValueError(f"--cluster_spec={text!r} names no job. Expected e.g. '{EXAMPLE}'.")
    return spec


def from_tf_config(environ=None):
    """(cluster dict, task dict or None) from TF_CONFIG, or (None, None) if it is not set."""
    environ = os.environ if environ is None else environ
    if 'TF_CONFIG' not in environ:
        return None, None
    try:
        config = json.loads(environ['TF_CONFIG'])
        spec = config['cluster']
        if not isinstance(spec, dict):
            raise TypeError('"cluster" is not a dict')
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f'TF_CONFIG has no readable cluster ({type(e).__name__}: {e}). Expected e.g. '
            '{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, '
            '"task": {"type": "worker", "index": 0}}.'
        ) from None
    return spec, config.get('task')


def _answers(address, timeout):
    host, _, port = address.rpartition(':')
    try:
        with socket.create_connection((host.strip('[]'), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def unreachable(spec, jobs=None, timeout=1.0):
    """[(job, index, address)] of the tasks whose port does not accept a connection."""
    return [
        (job, i, address)
        for job, addresses in spec.items()
        if jobs is None or job in jobs
        for i, address in enumerate(addresses)
        if not _answers(address, timeout)
    ]


def gone(spec, jobs=None, within=3.0, poll=0.2):
    """After a lost connection: the tasks that stopped answering, polled for up to `within`
    seconds (a killed worker's port closes a moment after its connections drop)."""
    deadline = time.monotonic() + within
    while True:
        missing = unreachable(spec, jobs)
        if missing or time.monotonic() >= deadline:
            return missing
        time.sleep(poll)


def describe(tasks):
    return ', '.join(f'{job} {i} ({address})' for job, i, address in tasks)


def is_tf_server(address, timeout):
    """Whether TF's worker service answers at `address` (its GetStatus RPC, over TF's own
    gRPC transport): a port that accepts connections but speaks something else — another
    program on that port — would otherwise pass for a worker and hang the first real call."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        status = channel.unary_unary('/tensorflow.WorkerService/GetStatus')
        try:
            status(b'', timeout=timeout)  # GetStatusRequest has no fields: empty bytes
            return True
        except grpc.RpcError:
            return False


def wait_for(spec, timeout, jobs=None, log=None, poll=0.5):
    """Returns once every task of `jobs` answers as a TF server; TimeoutError naming each
    silent task after `timeout` seconds, and each port that answers in another protocol. Pure
    Python sleeps: Ctrl-C interrupts it at once."""
    deadline = time.monotonic() + timeout
    missing = unreachable(spec, jobs)
    said = None
    while True:
        if not missing:
            strangers = [
                (job, i, address)
                for job, addresses in spec.items()
                if jobs is None or job in jobs
                for i, address in enumerate(addresses)
                if not is_tf_server(address, max(1.0, min(5.0, deadline - time.monotonic())))
            ]
            if not strangers:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f'{describe(strangers)}: the port accepts connections but no TF server '
                    f'answered there within {timeout:g} s (another program on that port?). '
                    'Check the cluster spec, or start tf_gpipe_worker on a free port.'
                )
            time.sleep(poll)
            missing = unreachable(spec, jobs)
            continue
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f'{len(missing)} task(s) did not answer within {timeout:g} s: '
                f'{describe(missing)}. Start each with `tf_gpipe_worker '
                f"--cluster_spec='<the same spec>' --task_index=<i>` (or `python -m "
                'tf_gpipe.runtime.worker` with TF_CONFIG), or raise --connect_timeout.'
            )
        if log is not None and missing != said:
            log(f'Waiting for {describe(missing)} (up to {timeout:g} s) ...')
            said = missing
        time.sleep(poll)
        missing = unreachable(spec, jobs)
