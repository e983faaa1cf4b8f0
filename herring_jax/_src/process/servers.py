"""Server-only processes: their rendezvous with the workers, and `herring-jax serve`.

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

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time

from herring_jax._src.process import knobs
from herring_jax._src.process.errors import HerringError

PROG = "herring-jax serve"
# How often a server tries to reach rank 0 while it is not listening yet.
_RETRY_S = 0.05


def rendezvous_address(coordinator: str) -> tuple[str, int]:
    """(host, port) where rank 0 waits for servers, given the coordinator's host:port."""
    host, _, port = coordinator.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    chosen = knobs.get("HERRING_SERVER_PORT")
    if chosen:
        return host, chosen
    try:
        return host, int(port) + 1
    except ValueError:
        raise HerringError(f"coordinator address {coordinator!r} is not host:port") from None


def _send(f, message: dict) -> None:
    f.write((json.dumps(message) + "\n").encode())
    f.flush()


def _receive(f, what: str) -> dict:
    line = f.readline()
    if not line:
        raise HerringError(f"the other side closed the server rendezvous before {what}")
    return json.loads(line)


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


def serve(coordinator: str, index: int | None = None) -> int:
    """Runs this process as a server-only process of the job whose
    jax.distributed coordinator is `coordinator` (host:port); returns the exit code."""
    from herring_jax._src.process import joining, runtime  # import jax and the extension
    from herring_jax import _herring_ffi as ext

    host, port = rendezvous_address(coordinator)
    timeout_s = knobs.get("HERRING_INIT_TIMEOUT_S")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=timeout_s)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                print(f"{PROG}: cannot reach rank 0 at {host}:{port} within {timeout_s:g} s "
                      f"(HERRING_INIT_TIMEOUT_S): {e}", file=sys.stderr, flush=True)
                return 1
            time.sleep(_RETRY_S)
    # The connection stays open while this process serves: rank 0 takes its
    # close for this process's end (Rendezvous.watch).
    with conn.makefile("rwb") as f:
        _send(f, {"index": index, "pid": os.getpid(), "host": socket.gethostname()})
        s = _receive(f, "the job's settings")
        provider = s["provider"]
        interface = joining.fabric_interface(provider, f"{host}:{port}")
        handle = ext.create_communicator(
            s["rank"], s["size"], s["token"], provider, interface,
            knobs.get("HERRING_FI_FORCE_MR"), s["chunk_bytes"], knobs.get("HERRING_SERVER_THREADS"),
            s["timeout_s"], s["heartbeat_s"], s["peer_timeout_s"], knobs.get("HERRING_MAX_POSTED"),
            min_chunk_bytes=s["min_chunk_bytes"], workers=s["workers"],
            server_share=s["server_share"])
        try:
            _send(f, {"address": ext.address(handle).hex()})
            addresses = [bytes.fromhex(a) for a in _receive(f, "every rank's address")["addresses"]]
            ext.connect(handle, addresses)
        except BaseException:
            ext.destroy(handle)
            conn.close()
            raise
    rank = s["rank"]
    print(f"{PROG}: rank {rank} of {s['size']} serves {s['workers']} workers "
          f"({ext.describe(handle)})", file=sys.stderr, flush=True)
    exit_s = knobs.get("HERRING_TEST_SERVER_EXIT_S")
    if exit_s is not None:
        timer = threading.Timer(exit_s, os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()
    kill_at = knobs.get("HERRING_TEST_SERVER_KILL_AT_CHUNK")
    if kill_at is not None and knobs.get("HERRING_RESTART") == 0:
        threading.Thread(target=_kill_at_chunk, args=(ext, handle, kill_at),
                         daemon=True).start()
    why = ext.serve(handle)
    stats = ext.stats(handle)
    ext.destroy(handle)
    conn.close()
    print("HERRING_RESULT " + json.dumps({
        "server": rank, "ok": not why, "served_chunks": stats["served_chunks"],
        "served_bytes": stats["served_bytes"], "messages_dropped": stats["messages_dropped"]}),
        flush=True)
    if why:
        print(f"{PROG}: rank {rank}: the job failed: {why}", file=sys.stderr, flush=True)
        return 1
    return 0


def _kill_at_chunk(ext, handle, chunks: int) -> None:
    """HERRING_TEST_SERVER_KILL_AT_CHUNK: SIGKILL once `chunks` chunks are summed
    (ext.serve runs without the GIL; the counter is an atomic)."""
    while ext.stats(handle)["served_chunks"] < chunks:
        time.sleep(0.002)
    os.kill(os.getpid(), signal.SIGKILL)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `herring-jax serve`'s options."""
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        default=knobs.get("HERRING_COORDINATOR_ADDRESS"),
                        help="the job's jax.distributed coordinator address (the one the "
                             "workers get); the server meets rank 0 at its port + 1, or at "
                             "HERRING_SERVER_PORT (default: HERRING_COORDINATOR_ADDRESS)")
    parser.add_argument("--index", type=int, metavar="J",
                        help="this server's number 0..K-1, which fixes its rank (workers + J); "
                             "default: ranks in the order the servers reach rank 0")
    parser.set_defaults(serve_parser=parser)


def run(args: argparse.Namespace) -> int:
    """Runs `herring-jax serve` as parsed by add_arguments."""
    if not args.coordinator:
        args.serve_parser.error("--coordinator HOST:PORT is required (or set "
                                "HERRING_COORDINATOR_ADDRESS)")
    if args.index is not None and args.index < 0:
        args.serve_parser.error(f"--index must be at least 0, got {args.index}")
    try:
        return serve(args.coordinator, args.index)
    except HerringError as e:
        print(f"{PROG}: {e}", file=sys.stderr, flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m herring_jax.serve`."""
    parser = argparse.ArgumentParser(prog="python -m herring_jax.serve", allow_abbrev=False,
                                     description="A server-only process of a herring_jax job.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


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
    return Rendezvous(rendezvous_address(coordinator or "127.0.0.1:0")[1], servers)


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
