"""Server-only processes, the workers' side: rank 0's rendezvous with them,
and what every worker learns of them (`herring-jax serve` itself, which
imports no jax, is herring_jax/_src/launcher/serving.py; what the two sides
say to each other, server_wire.py).

A server-only process trains nothing: it sums the parts of each all-reduce
that the workers place on it (xla_ffi/engine/served.cc) and sends the sums
back. It cannot join jax.distributed (every process jax knows counts in
jax.process_count(), and its coordinator refuses a task beyond
num_processes), so it meets the workers through a rendezvous of herring's own:
rank 0 listens on a TCP port (HERRING_SERVER_PORT; by default the
coordinator's port + 1) while initialize() runs, tells each server its rank
and the job's settings, takes its endpoint address and publishes it in
jax.distributed's key-value store for the other workers, and finally sends
it every rank's address. Messages are lines of JSON.

Ranks: the workers keep 0 .. n-1 (jax's process indices); the servers are
n .. n+k-1, in the order of their --index (else of their arrival). From then
on a server is a rank of herring's communicator like any other: it sends and
gets heartbeats, aborts and the leave protocol's notices, so a killed server
fails every worker that waits for it, naming its rank, and a failing worker
ends the servers too. A server ends by itself once every worker has left.
"""

from __future__ import annotations

import socket
import threading
import time

from herring_jax._src.process import knobs
from herring_jax._src.process import server_wire as wire
from herring_jax._src.process.errors import HerringError

_send = wire.send


def _receive(f, what: str) -> dict:
    try:
        return wire.receive(f, what)
    except wire.RendezvousError as e:
        raise HerringError(str(e)) from None


class Rendezvous:
    """Rank 0's side: a listening socket, then one connection per server."""

    def __init__(self, port: int, servers: int):
        self.servers = servers
        self.port = port
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(("", port))
        except OSError as e:
            self._sock.close()
            raise HerringError(
                f"rank 0 cannot listen for the {servers} server-only processes on port {port}: "
                f"{e}; choose another with HERRING_SERVER_PORT") from e
        self._sock.listen(servers)
        self._conns: list[tuple[socket.socket, object]] = []  # by server index

    def accept(self, settings: dict, workers: int, timeout_s: float) -> list[tuple[bytes, int]]:
        """Waits for every server, gives each its rank and `settings`, and
        returns their endpoint addresses and pids in rank order."""
        deadline = time.monotonic() + timeout_s
        hellos = []
        while len(hellos) < self.servers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HerringError(
                    f"rank 0 waited {timeout_s:g} s (HERRING_INIT_TIMEOUT_S) for "
                    f"{self.servers} server-only processes (HERRING_SERVERS) on port "
                    f"{self.port} and {len(hellos)} came: start the others with `herring-jax "
                    "serve --coordinator HOST:PORT` (the jax coordinator's address), or set "
                    "HERRING_SERVERS to the number that runs")
            self._sock.settimeout(left)
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            conn.settimeout(timeout_s)
            f = conn.makefile("rwb")
            hello = _receive(f, "its hello")
            hellos.append((hello.get("index"), len(hellos), conn, f, int(hello.get("pid", 0))))
        # Launched servers say their index; others are numbered as they came.
        hellos.sort(key=lambda h: (h[0] is None, h[0] if h[0] is not None else 0, h[1]))
        addresses = []
        for j, (_, _, conn, f, pid) in enumerate(hellos):
            _send(f, {**settings, "rank": workers + j})
            address = bytes.fromhex(_receive(f, "its address")["address"])
            # The pid only fills the topology: a server's host takes no host stage.
            addresses.append((address, pid if pid > 0 else 1))
            self._conns.append((conn, f))
        return addresses

    def finish(self, addresses: list[bytes]) -> None:
        """Sends every server all ranks' addresses and stops listening; the
        connections stay open for watch()."""
        try:
            for _, f in self._conns:
                _send(f, {"addresses": [a.hex() for a in addresses]})
        except BaseException:
            self.close()
            raise
        self._sock.close()

    def watch(self, workers: int, on_gone) -> None:
        """Calls on_gone(rank, how) once for the first server whose
        connection closes: a server keeps it open while it serves, so that
        means its process is gone (the kernel closes a killed process's
        sockets at once). A slow server is never taken for a dead one; a
        server whose host vanishes (no close) is left to the peer watch
        (HERRING_PEER_TIMEOUT_S). Ends at close()."""
        self._stop = threading.Event()
        conns = {conn.fileno(): (workers + j, conn) for j, (conn, _) in enumerate(self._conns)}
        for _, conn in conns.values():
            conn.setblocking(False)

        def loop():
            import select
            while not self._stop.is_set() and conns:
                try:
                    ready, _, _ = select.select(list(conns), [], [], 0.5)
                except (OSError, ValueError):
                    return  # closed under us: close() ran
                for fd in ready:
                    rank, conn = conns[fd]
                    try:
                        data = conn.recv(1)
                        how = "its process exited or was killed" if not data else None
                    except BlockingIOError:
                        continue
                    except OSError as e:
                        how = f"its connection failed: {e.strerror or e}"
                    if how is None:
                        continue  # a server sends nothing more; ignore stray bytes
                    if not self._stop.is_set():
                        on_gone(rank, how)
                    return

        self._watcher = threading.Thread(target=loop, name="herring-server-watch", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        for conn, f in self._conns:
            try:
                f.close()
            finally:
                conn.close()
        self._conns = []
        self._sock.close()


def job_servers(client, prefix: str, rank: int, timeout_ms: int) -> tuple[int, float, int]:
    """(server-only processes, share placed on them (-1: the engine's split),
    the smallest buffer placed on them in bytes) as rank 0 holds them
    (HERRING_SERVERS, HERRING_SERVER_SHARE, HERRING_SERVER_MIN_BYTES): every
    worker must lay parts out alike."""
    if rank == 0:
        share = knobs.get("HERRING_SERVER_SHARE")
        client.key_value_set(f"{prefix}/servers",
                             f'{knobs.get("HERRING_SERVERS")} {-1.0 if share is None else share} '
                             f'{knobs.get("HERRING_SERVER_MIN_BYTES")}')
    count, share, min_bytes = client.blocking_key_value_get(f"{prefix}/servers",
                                                            timeout_ms).split()
    return int(count), float(share), int(min_bytes)


def open_rendezvous(servers: int, coordinator: str | None) -> Rendezvous:
    """Rank 0's listening socket for `servers` server-only processes."""
    if not coordinator and not knobs.get("HERRING_SERVER_PORT"):
        raise HerringError(
            "HERRING_SERVERS is set but the coordinator's address is unknown here (jax found "
            "the cluster by itself): set HERRING_SERVER_PORT, and give the servers "
            "`herring-jax serve --coordinator RANK0_HOST:ANY` with it set too")
    try:
        port = wire.rendezvous_address(coordinator or "127.0.0.1:0")[1]
    except wire.RendezvousError as e:
        raise HerringError(str(e)) from None
    return Rendezvous(port, servers)


def publish(client, prefix: str, workers: int, servers: list[tuple[bytes, int]]) -> None:
    """Rank 0: the servers' addresses and pids, for every worker."""
    for j, (address, pid) in enumerate(servers):
        client.key_value_set_bytes(f"{prefix}/addr/{workers + j}", address)
        client.key_value_set(f"{prefix}/server_pid/{workers + j}", str(pid))


def with_servers(topology, client, prefix: str, timeout_ms: int, workers: int, servers: int):
    """The workers' topology with each server on a host of its own (numbered
    after theirs), which never takes the host stage."""
    import dataclasses
    pids = [int(client.blocking_key_value_get(f"{prefix}/server_pid/{workers + j}", timeout_ms))
            for j in range(servers)]
    hosts = (max(topology.host_of) + 1) if topology.host_of else 0
    return dataclasses.replace(
        topology,
        host_of=list(topology.host_of) + [hosts + j for j in range(servers)],
        pid_of=list(topology.pid_of) + pids,
        memory_shared=list(topology.memory_shared) + [False] * servers,
        reasons=list(topology.reasons) + ["a server-only process"] * servers,
        board_shared=(list(topology.board_shared) + [False] * servers
                      if topology.board_shared else []),
        board_reasons=(list(topology.board_reasons) + ["a server-only process"] * servers
                       if topology.board_reasons else []))
