"""Starts N local processes of one command, wired up for herring_jax.initialize().

Usage (the two forms are the same)::

  python -m herring_jax.launch -n N [--devices-per-process D] [--coordinator-port P]
                               [--timeout S] [--netns [--host-rate R --flow-rate F]
                               [--processes-per-host P]]
                               -- COMMAND [ARG ...]
  herring-jax launch -n 4 --devices-per-process 2 -- python train.py --steps 100
  herring-jax launch -n 4 --netns --host-rate 1gbit --flow-rate 250mbit -- python train.py
  herring-jax launch -n 4 --max-restarts 3 [--min-processes 2] -- python train.py
  herring-jax launch -n 4 --servers 2 -- python train.py

Each child gets the launcher's environment plus HERRING_COORDINATOR_ADDRESS
(127.0.0.1:P, P a free port by default), HERRING_NUM_PROCESSES,
HERRING_PROCESS_ID, HERRING_LOCAL_RANK and PYTHONUNBUFFERED=1; with
--devices-per-process D also --xla_force_host_platform_device_count=D in
XLA_FLAGS and JAX_PLATFORMS=cpu unless set. Output lines keep their stream and
are prefixed with "[rank i] ".

With --netns each process runs as its own "host": a network namespace on a
bridge, rate-limited with --host-rate (each host's egress) and --flow-rate
(each host-to-host flow), see herring_jax/_src/launcher/netns.py. With
--processes-per-host P, P consecutive ranks share each namespace (N/P hosts)
and HERRING_LOCAL_RANK is the rank's index on its host. The coordinator is
then rank 0's address. Everything created is removed when the job ends, also
on failure or Ctrl-C. Needs root and iproute2.

With --servers K, K server-only processes (`python -m herring_jax.serve
--index J`, ranks N .. N+K-1 of herring's communicator, outside jax.distributed:
jax.process_count() stays N) start beside the N ranks; each worker gets
HERRING_SERVERS=K and HERRING_SERVER_PORT, where rank 0 meets them. With --netns
each server runs on a simulated host of its own. Their output is prefixed
"[rank N+J] ". A server ends by itself once every worker has left; one that
fails fails the job like a rank.

The first child to fail stops the job: the others get up to 3 s to end by
themselves, then SIGTERM, SIGKILL after HERRING_LAUNCH_GRACE_S seconds
(default 10), and the launcher exits with that
child's code (128 + N for a death by signal N), or with that of a child that
died by a signal while the others were ending by themselves (a killed rank's
peers fail at once, and one may reach the launcher first). --timeout expiry
exits 124;
SIGINT, SIGTERM or SIGHUP to the launcher stops every child the same way and
exits 130, 143 or 129; the children get SIGTERM, and the wait before SIGKILL
is then the larger of HERRING_LAUNCH_GRACE_S and HERRING_PREEMPTION_GRACE_S
+ 2 s (22 s by default), so that ranks that save on preemption
(herring_jax.preemption_requested) can finish their checkpoint; a second
signal (Ctrl-C again) ends the wait at once.
Each child leads its own process group and whole
groups are killed, so nothing a rank started outlives the job. A launcher
killed outright (SIGKILL, e.g. by a test harness's timeout) cannot do that:
on Linux each child gets SIGKILL as its parent-death signal, so the ranks die
with it (a rank's own children then live on unless the rank gives them a
parent-death signal too). Standard library only: the launcher never imports
jax.

With --max-restarts K a failed run (a rank's non-zero exit or death by a
signal; the others are stopped as above) is followed by a new run of the whole
job, up to K times, each child told its run's number in HERRING_RESTART
(0 first), with one line per restart naming the rank that failed and how. A
stop by a signal or --timeout (one deadline for all runs) is never restarted.
With --min-processes M, a host (a process; with --netns a simulated host) that
failed in two runs in a row is left out of the next one if at least M
processes remain: the ranks are numbered from 0 again, and the program
resumes from its checkpoint on fewer processes. The exit code is the last
run's.

A run whose ranks each exited with 0 or 75 (herring_jax.PREEMPTED_EXIT_CODE:
saved for a preemption), one at least with 75, exits 75, also after a stop
signal to the launcher; it is never restarted (the scheduler that requeues a
preempted job resumes it).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time

from herring_jax._src.launcher.launch_job import EXIT_TIMEOUT, PROG, _exit_code, _grace_s, _Job
from herring_jax._src.launcher.launch_restarts import RESTART_ENV, Restarts
from herring_jax._src.process.exit_status import PREEMPTED_EXIT_CODE
from herring_jax._src.process.ports import free_port, port_in_use  # noqa: F401 (re-exported)

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_DEVICE_FLAG_RE = re.compile(rf"(?:^|\s){_DEVICE_FLAG}(?:=\S*)?(?=\s|$)")


def _number(cast, low, strict: bool = False):
    """Returns an argparse type: cast(text), >= low (> low if strict), readable errors."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            kind = "an integer" if cast is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(
                f"must be {'greater than' if strict else 'at least'} {low}, got {text}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the launcher's options to parser, a parser or `herring-jax` subparser."""
    parser.add_argument("-n", "--num-processes", type=_number(int, 1), required=True,
                        metavar="N", help="number of processes to start (>= 1)")
    parser.add_argument("--devices-per-process", type=_number(int, 1), metavar="D",
                        help="CPU devices per process: sets XLA_FLAGS and JAX_PLATFORMS=cpu")
    parser.add_argument("--coordinator-port", type=_number(int, 0), default=0, metavar="P",
                        help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--timeout", type=_number(float, 0, strict=True), metavar="S",
                        help=f"stop every process after S seconds and exit {EXIT_TIMEOUT}")
    net = parser.add_argument_group(
        "simulated network", "one network namespace per process (needs root and iproute2)")
    net.add_argument("--netns", action="store_true",
                     help="run each process in its own namespace on a bridge, as one host")
    net.add_argument("--host-rate", metavar="RATE",
                     help="with --netns: each host's egress cap, e.g. 1gbit")
    net.add_argument("--flow-rate", metavar="RATE",
                     help="with --netns: each host-to-host flow's cap, e.g. 250mbit")
    net.add_argument("--processes-per-host", type=_number(int, 1), default=1, metavar="P",
                     help="with --netns: P processes share each host's namespace (ranks "
                          "hP..hP+P-1 on host h); N must be a multiple of P")
    parser.add_argument("--servers", type=_number(int, 0), default=0, metavar="K",
                        help="also start K server-only processes, which only sum (see "
                             "docs/guides/servers.md); the program still sees -n processes")
    restarts = parser.add_argument_group(
        "restarts", "start the whole job again after a failure (the program resumes from "
        "its checkpoint)")
    restarts.add_argument("--max-restarts", type=_number(int, 0), default=0, metavar="K",
                          help="after a rank fails, stop the others and start the job again, "
                               f"up to K times; each run gets {RESTART_ENV}=0, 1, ... "
                               "(default 0: no restarts)")
    restarts.add_argument("--min-processes", type=_number(int, 1), metavar="M",
                          help="with --max-restarts: leave out a process (with --netns: a "
                               "host) that failed in two runs in a row, while at least M "
                               "processes remain")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="the command every process runs, after '--'")
    # run() must report a missing command as a usage error of whichever parser
    # (standalone or subcommand) was used, so it is remembered here.
    parser.set_defaults(launch_parser=parser)


def child_env(base: dict, rank: int, num_processes: int, port: int,
              devices_per_process: int | None = None, host: str = "127.0.0.1",
              local_rank: int | None = None, restart: int = 0) -> dict:
    """Builds one child's environment.

    Args:
      base: the environment to extend (normally os.environ); not modified.
      rank: the child's process id.
      num_processes: the number of children.
      port: the coordinator port.
      devices_per_process: if set, the number of host-platform devices.
      host: the coordinator's address (rank 0's host).
      local_rank: its index among the processes of its host (default: rank).
      restart: the run's number under --max-restarts (0: the first run).

    Returns:
      A new dict with the HERRING_* variables (and XLA settings) added.
    """
    env = dict(base)
    env.update({
        "HERRING_COORDINATOR_ADDRESS": f"{host}:{port}",
        "HERRING_NUM_PROCESSES": str(num_processes),
        "HERRING_PROCESS_ID": str(rank),
        "HERRING_LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "PYTHONUNBUFFERED": "1",
        RESTART_ENV: str(restart),
    })
    if devices_per_process is not None:
        # Replaced, not appended: two copies would leave a reader of the
        # environment guessing which one XLA honours.
        flags = _DEVICE_FLAG_RE.sub("", env.get("XLA_FLAGS", "")).strip()
        env["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={devices_per_process}".lstrip()
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def run(args: argparse.Namespace) -> int:
    """Runs the job that add_arguments() parsed.

    Returns:
      0 when every process succeeded, else the code the module docstring gives.
    """
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        message = "no command given: put it after '--', e.g. -n 2 -- python train.py"
        parser = getattr(args, "launch_parser", None)
        if parser is not None:
            parser.error(message)  # exits with status 2 and the usage line
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    n = args.num_processes
    netns = getattr(args, "netns", False)
    if not netns and (getattr(args, "host_rate", None) or getattr(args, "flow_rate", None)):
        print(f"{PROG}: error: --host-rate and --flow-rate need --netns", file=sys.stderr)
        return 2
    per_host = getattr(args, "processes_per_host", 1) or 1
    if per_host > 1 and not netns:
        print(f"{PROG}: error: --processes-per-host needs --netns (without it every "
              "process already runs on this one host)", file=sys.stderr)
        return 2
    if n % per_host:
        print(f"{PROG}: error: -n {n} is not a multiple of --processes-per-host {per_host}",
              file=sys.stderr)
        return 2
    max_restarts = getattr(args, "max_restarts", 0) or 0
    min_processes = getattr(args, "min_processes", None)
    if min_processes is not None and (not max_restarts or min_processes >= n):
        print(f"{PROG}: error: --min-processes {min_processes} needs --max-restarts K > 0 "
              f"and fewer processes than -n {n} (it says how far a restart may shrink the "
              "job)", file=sys.stderr)
        return 2
    restarts = Restarts(n // per_host, per_host, max_restarts, min_processes)
    num_servers = getattr(args, "servers", 0) or 0
    net = None
    if netns:
        from herring_jax._src.launcher.netns import SimulatedNetwork
        try:
            # Each server on a host of its own, after the workers' hosts.
            net = SimulatedNetwork(n // per_host + num_servers, args.host_rate,
                                   args.flow_rate)
        except ValueError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
    # In a fresh namespace every port is free.
    port = args.coordinator_port or (29400 if net else free_port())
    if not net and args.coordinator_port and port_in_use(port):
        # jax's coordination service would join the other job's: both fail.
        print(f"{PROG}: error: --coordinator-port {port} is in use on 127.0.0.1 (another "
              "job's coordinator?); choose another port, or leave the option out for a free "
              "one", file=sys.stderr)
        return 2
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    job = _Job(_grace_s())
    # One handler for every run: it reaches whichever job runs now.
    current = [job]

    def on_signal(signum, frame):
        current[0].on_signal(signum, frame)

    # Handlers go in before any child exists, so a Ctrl-C during start-up
    # cannot leave children running; signal.signal only works on the main thread.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in _STOP_SIGNALS}
    message = failed_rank = None
    try:
        if net is not None:
            from herring_jax._src.launcher.netns import NetnsError
            try:
                net.create()
            except NetnsError as e:
                job.say(f"cannot build the simulated network: {e}")
                return 2
            job.say(f"simulated network: {net.describe()}")
        while True:
            code = _start_all(job, command, args, restarts, net, port)
            if code is not None:
                return code
            code, message, failed_rank = job.wait_for_end(args.timeout, deadline)
            if failed_rank is None and job.servers:
                job.let_servers_end()
            if failed_rank is None:
                if job.signals:
                    # Ranks that catch the signal save and exit with
                    # PREEMPTED_EXIT_CODE: then so does the launcher.
                    job.stop(message)
                    message = None
                    if job.ended_preempted():
                        code = PREEMPTED_EXIT_CODE
                if code == PREEMPTED_EXIT_CODE:
                    # Never restarted here: a preempted machine is going away,
                    # and the scheduler that requeues the job resumes it.
                    job.say(f"the ranks saved for a preemption and exited with "
                            f"{PREEMPTED_EXIT_CODE}; resume from the checkpoint (no restart "
                            "under --max-restarts: the scheduler requeues a preempted job)")
                return code
            job.stop(message, failed_rank)
            message = failed_rank = None  # stopped: the finally clause has nothing left
            if job.signals:  # stopped by hand while stopping: no restart
                return 128 + job.signals[0]
            rank, returncode, why = job.verdict
            code = _exit_code(returncode)
            line = (restarts.after_server_failure(job.who(rank), why) if rank in job.servers
                    else restarts.after_failure(rank, why))
            if line is None:
                if max_restarts:
                    job.say(f"giving up: the job failed again after {max_restarts} "
                            f"restart{'s' if max_restarts > 1 else ''} (--max-restarts)")
                return code
            job.say(line)
            job = _Job(_grace_s())
            current[0] = job
            if not net:
                # The last run's coordinator may still hold its port for a moment.
                port = args.coordinator_port or free_port()
            else:
                # Two ports on: the last run's server rendezvous (port + 1)
                # may still be held in rank 0's namespace.
                port += 2
    finally:
        job.stop(message, failed_rank)
        if net is not None:
            net.destroy()  # after every process in it has ended
        for s, handler in previous.items():
            signal.signal(s, handler)


def _start_all(job: _Job, command: list[str], args, restarts: Restarts, net,
               port: int) -> int | None:
    """Starts every process of the next run; returns an exit code if one cannot start."""
    n, per_host = restarts.num_processes, restarts.per_host
    num_servers = getattr(args, "servers", 0) or 0
    coordinator_host = net.address(restarts.slots[0]) if net else "127.0.0.1"
    server_env = {}
    if num_servers:
        # In a fresh namespace the port after the coordinator's is free.
        server_env = {"HERRING_SERVERS": str(num_servers),
                      "HERRING_SERVER_PORT": str(port + 1 if net else free_port())}
    for rank in range(n):
        host = restarts.slot_of(rank)
        try:
            job.start(rank, net.wrap(host, command) if net else command,
                      {**child_env(os.environ, rank, n, port, args.devices_per_process,
                                   coordinator_host,
                                   local_rank=rank % per_host if net else rank,
                                   restart=restarts.restart), **server_env})
        except OSError as e:
            job.say(f"cannot start {command[0]!r}: {e}")
            return 126 if isinstance(e, PermissionError) else 127
    for j in range(num_servers):
        serve = [sys.executable, "-m", "herring_jax.serve", "--index", str(j)]
        env = {**os.environ, **server_env, "PYTHONUNBUFFERED": "1",
               "HERRING_COORDINATOR_ADDRESS": f"{coordinator_host}:{port}",
               RESTART_ENV: str(restarts.restart)}
        env.setdefault("JAX_PLATFORMS", "cpu")  # a server needs no accelerator
        for name in ("HERRING_NUM_PROCESSES", "HERRING_PROCESS_ID", "HERRING_LOCAL_RANK"):
            env.pop(name, None)
        try:
            job.start(n + j, net.wrap(restarts.hosts + j, serve) if net else serve, env,
                      server=True)
        except OSError as e:
            job.say(f"cannot start server {j}: {e}")
            return 126 if isinstance(e, PermissionError) else 127
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m herring_jax.launch`; argv defaults to sys.argv[1:]."""
    parser = argparse.ArgumentParser(
        prog="python -m herring_jax.launch", allow_abbrev=False,
        description="Start N local processes of a command for herring_jax.",
        epilog="example: python -m herring_jax.launch -n 4 -- python train.py")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
