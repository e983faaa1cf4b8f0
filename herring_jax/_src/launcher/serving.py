"""`herring-jax serve` (and `python -m herring_jax.serve`): a server-only
process of a herring_jax job. It sums the parts of each all-reduce that the
workers place on it and sends the sums back (xla_ffi/engine/served.cc); how
it meets the workers is in herring_jax/_src/process/servers.py, rank 0's
side.

It imports neither jax nor anything that does (tests/test_layout.py checks
the launcher's modules, this one among them, with jax unimportable): a
server runs no jax program, and jax's import alone took about 1 s of CPU
per server process.
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

# fabric_env.py, imported with the package, has said what to do if it is missing.
from herring_jax import _herring_ffi as ext
from herring_jax._src.process import addresses
from herring_jax._src.process import knobs
from herring_jax._src.process import server_wire as wire

PROG = "herring-jax serve"
# How often a server tries to reach rank 0 while it is not listening yet.
_RETRY_S = 0.05


def serve(coordinator: str, index: int | None = None) -> int:
    """Runs this process as a server-only process of the job whose
    jax.distributed coordinator is `coordinator` (host:port); returns the exit code."""
    host, port = wire.rendezvous_address(coordinator)
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
        wire.send(f, {"index": index, "pid": os.getpid(), "host": socket.gethostname()})
        s = wire.receive(f, "the job's settings")
        provider = s["provider"]
        interface = addresses.fabric_interface(provider, f"{host}:{port}")
        handle = ext.create_communicator(
            s["rank"], s["size"], s["token"], provider, interface,
            knobs.get("HERRING_FI_FORCE_MR"), s["chunk_bytes"], knobs.get("HERRING_SERVER_THREADS"),
            s["timeout_s"], s["heartbeat_s"], s["peer_timeout_s"], knobs.get("HERRING_MAX_POSTED"),
            min_chunk_bytes=s["min_chunk_bytes"], workers=s["workers"],
            server_share=s["server_share"])
        try:
            wire.send(f, {"address": ext.address(handle).hex()})
            every = wire.receive(f, "every rank's address")["addresses"]
            ext.connect(handle, [bytes.fromhex(a) for a in every])
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
        "served_bytes": stats["served_bytes"], "messages_dropped": stats["messages_dropped"],
        # A server runs no jax program: tests check that nothing imported jax.
        "jax_imported": "jax" in sys.modules}),
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
    except wire.RendezvousError as e:
        print(f"{PROG}: {e}", file=sys.stderr, flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m herring_jax.serve`."""
    parser = argparse.ArgumentParser(prog="python -m herring_jax.serve", allow_abbrev=False,
                                     description="A server-only process of a herring_jax job.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
