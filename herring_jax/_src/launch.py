"""Starts N local processes of a command with what herring_jax.initialize() needs.

Usage:
  python -m herring_jax.launch -n 4 [--devices-per-process 2] -- python train.py
  herring-jax launch -n 4 -- python train.py

Each child gets HERRING_COORDINATOR_ADDRESS (127.0.0.1 and a free port),
HERRING_NUM_PROCESSES, HERRING_PROCESS_ID and HERRING_LOCAL_RANK; with
--devices-per-process D also XLA_FLAGS=--xla_force_host_platform_device_count=D
and JAX_PLATFORMS=cpu (unless set). Output lines are prefixed with
"[rank i] ". When one child fails, the others are stopped (SIGTERM, then
SIGKILL after a grace period) and its exit code is returned, so a crashed peer
never leaves the rest of the job hanging.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

_GRACE_ENV = "HERRING_LAUNCH_GRACE_S"
_DEFAULT_GRACE_S = 10.0
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--num-processes", type=int, required=True,
                        help="number of processes to start (>= 1)")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="CPU devices per process (sets XLA_FLAGS)")
    parser.add_argument("--coordinator-port", type=int, default=None,
                        help="jax.distributed coordinator port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop every process after this many seconds (exit code 124)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- followed by the command to run in every process")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(base: dict, rank: int, n: int, port: int, devices: int | None) -> dict:
    env = dict(base)
    env.update({
        "HERRING_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "HERRING_NUM_PROCESSES": str(n),
        "HERRING_PROCESS_ID": str(rank),
        "HERRING_LOCAL_RANK": str(rank),
        "PYTHONUNBUFFERED": "1",
    })
    if devices is not None:
        flags = re.sub(rf"\s*{_DEVICE_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).strip()
        env["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={devices}".strip()
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _pump(stream, sink, prefix: str, lock: threading.Lock) -> None:
    # Whole lines under one lock, so ranks never interleave within a line.
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if not line.endswith("\n"):
            line += "\n"
        with lock:
            sink.write(prefix + line)
            sink.flush()
    stream.close()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _stop(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("herring-jax launch: no command given; usage: herring-jax launch -n N -- CMD ...",
              file=sys.stderr)
        return 2
    n = args.num_processes
    if n < 1:
        print(f"herring-jax launch: -n must be at least 1, got {n}", file=sys.stderr)
        return 2
    port = args.coordinator_port or _free_port()
    grace = float(os.environ.get(_GRACE_ENV, _DEFAULT_GRACE_S))
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for rank in range(n):
        try:
            p = subprocess.Popen(command, env=child_env(os.environ, rank, n, port,
                                                        args.devices_per_process),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)
        except OSError as e:
            print(f"herring-jax launch: cannot start {command[0]!r}: {e}", file=sys.stderr)
            _stop(procs, signal.SIGKILL)
            return 127
        procs.append(p)
        for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, sink, f"[rank {rank}] ", lock),
                                 daemon=True)
            t.start()
            pumps.append(t)

    stop_signal: list[int] = []

    def on_signal(signum, _frame):
        stop_signal.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    result = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                result = _exit_code(code)
                alive = sum(c is None for c in codes)
                with lock:
                    print(f"herring-jax launch: rank {rank} exited with code {result}; "
                          f"stopping the other {alive} processes", file=sys.stderr, flush=True)
                break
            if all(c == 0 for c in codes):
                break
            if stop_signal:
                result = 128 + stop_signal[0]
                break
            if deadline is not None and time.monotonic() > deadline:
                with lock:
                    print(f"herring-jax launch: timed out after {args.timeout:g} s; stopping "
                          "every process", file=sys.stderr, flush=True)
                result = 124
                break
            time.sleep(0.05)
        _stop(procs, signal.SIGTERM)
        end = time.monotonic() + grace
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.05)
        _stop(procs, signal.SIGKILL)
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=5)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="herring-jax launch", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
