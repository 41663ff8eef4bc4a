"""Is a TF server we started reachable beyond loopback? One line that says so, and where.

TF's gRPC server binds every interface ("0.0.0.0:<port>", IPv4 and IPv6, in
`GrpcServer::Init`; `ServerDef` has a port but no address), whatever host the cluster spec
names, and TF's runtime has no authentication: whoever reaches the port can run any op as this
process's user (read and write its files). We cannot bind 127.0.0.1 only, so we check, by
connecting to this machine's own non-loopback addresses, and warn when the port answers there.
"""

import socket

_TIMEOUT = 0.5  # seconds per address: a local connect answers or is refused at once


def external_addresses():
    """This machine's non-loopback IP addresses (those a route or its host name gives)."""
    found = []
    # The source address the kernel would use towards a private address (a UDP connect sends
    # nothing; it fails when there is no such route).
    for family, probe in ((socket.AF_INET, '10.255.255.255'), (socket.AF_INET6, 'fd00::ffff')):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 1))
                found.append(s.getsockname()[0])
        except OSError:
            pass
    for name in {socket.gethostname(), socket.getfqdn()}:
        try:
            found += [info[4][0] for info in socket.getaddrinfo(name, None)]
        except OSError:
            pass
    out = []
    for addr in found:
        addr = addr.split('%')[0]  # an IPv6 zone
        if addr not in out and not _loopback(addr) and not addr.startswith('fe80'):
            out.append(addr)
    return out


def _loopback(addr):
    return addr.startswith('127.') or addr in ('::1', '0.0.0.0', '::')


def reachable_at(port, addresses=None):
    """The non-loopback addresses of this machine where `port` accepts a TCP connection."""
    reached = []
    for addr in external_addresses() if addresses is None else addresses:
        family = socket.AF_INET6 if ':' in addr else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(_TIMEOUT)
                if s.connect_ex((addr, port)) == 0:
                    reached.append(addr)
        except OSError:
            pass
    return reached


def warning(address, what='this TF server'):
    """One line when the port of `address` (a cluster spec's host:port) answers beyond
    loopback, else None."""
    port = int(address.rpartition(':')[2])
    reached = reachable_at(port)
    if not reached:
        return None
    where = ', '.join(f'[{a}]:{port}' if ':' in a else f'{a}:{port}' for a in reached)
    return (
        f'SECURITY: {what} (port {port}) is reachable beyond loopback at {where}: TF binds '
        'every interface and its runtime has no authentication, so anyone who can reach it '
        "can run ops as this user. Firewall the port to the cluster's hosts (docs/reliability.md, Security)."
    )
