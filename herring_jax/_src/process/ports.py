"""Choosing a TCP port on 127.0.0.1 for a job's coordinator or servers.

A port that the kernel hands out for ``bind(("127.0.0.1", 0))`` comes from the
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), the same range
every outgoing connection on the machine takes its local port from: jax's gRPC
clients, herring's transport, another job's. Between choosing such a port and
rank 0's coordinator binding it, a connection elsewhere can take it, and the
coordinator then fails to start ("address already in use"), which jaxlib has
answered with a crash. So a port is chosen at random below that range, where
no outgoing connection is placed, and checked free; only where the range
leaves no room below it does the kernel's choice stand.
"""

from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# Ports below this are left alone (well-known and registered services often
# listen in the low thousands).
_LOWEST = 10000
_TRIES = 64


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        with open(_RANGE_FILE) as f:
            lo, hi = (int(v) for v in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def port_in_use(port: int) -> bool:
    """Whether something listens on (or holds) 127.0.0.1:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the ephemeral range."""
    lo, _ = ephemeral_range()
    if lo - 1 > _LOWEST + _TRIES:
        rng = random.SystemRandom()
        for _ in range(_TRIES):
            port = rng.randint(_LOWEST, lo - 1)
            if not port_in_use(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
