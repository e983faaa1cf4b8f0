"""Faults injected into one process (HERRING_TEST_* knobs set per rank) while
every rank reduces; each rank reports what it got: its error, or whether its
result is exact.

Usage (under the launcher):
  python tests/workers/fault_worker.py reduce [--count N] [--rounds K] \
      [--env RANK:NAME=VALUE ...] [--stagger RANK:SECONDS ...]
  python tests/workers/fault_worker.py seals
  python tests/workers/fault_worker.py ptrace [--env RANK:NAME=VALUE ...]
  python tests/workers/fault_worker.py freeze --freeze-s F --late-s L

  reduce: every rank reduces float32[N] (sum) K times, each through
    herring_jax.allreduce; per round a `reduce` result: raised (HerringError)
    with its message and seconds, or exact (bitwise against the numpy
    reference of the host's order); then a `stats` result. The ranks start
    together (a barrier), each --stagger rank that many seconds later.
  seals: rank 1 takes rank 0's host board (pidfd_getfd) and tries to resize it
    and to map it writable; each must be refused (EPERM). Then every rank
    reduces once, exactly.
  ptrace: every rank reports its parent's pid, describe() and the tracer it
    declared (topology.declared_ptracer(); run with HERRING_TEST_PTRACE_SCOPE
    on a kernel without Yama), reduces once, shuts down and reports the
    declaration again.
  freeze: after a first reduction, rank 0 stops rank 1 (SIGSTOP) for F
    seconds, then both reduce again, rank 1 L seconds after it was thawed, so
    that rank 0 waits for it: a `reduce` result each (the second round).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import mmap
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.process import jax_compat  # noqa: E402


def _apply_env(assignments: list[str]) -> None:
    """RANK:NAME=VALUE: set NAME=VALUE in this process if it is rank RANK."""
    me = os.environ.get("HERRING_PROCESS_ID")
    for a in assignments:
        rank, _, rest = a.partition(":")
        name, _, value = rest.partition("=")
        if rank == me:
            os.environ[name] = value


def _reduce_once(rank: int, nproc: int, count: int, salt: int) -> None:
    x = common.make_input("float32", count, rank, salt)
    start = time.monotonic()
    try:
        got = np.asarray(herring_jax.allreduce(x))
    except herring_jax.HerringError as e:
        common.report("reduce", True, raised=True, seconds=time.monotonic() - start,
                      message=str(e)[:1500])
        return
    inputs = [[common.make_input("float32", count, r, salt)] for r in range(nproc)]
    want = common.reference("float32", "sum", inputs, common.hosts_from_env(nproc))
    common.report("reduce", True, raised=False, exact=common.bitwise_equal(got, want),
                  seconds=time.monotonic() - start)


def _pidfd_getfd(pid: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        got = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
        if got < 0:
            raise OSError(ctypes.get_errno(), "pidfd_getfd")
        return got
    finally:
        os.close(pidfd)


def _refused(action) -> str:
    """"refused" if `action` fails with EPERM, else what happened."""
    try:
        action()
    except PermissionError:
        return "refused"
    except OSError as e:
        return f"failed otherwise: {errno.errorcode.get(e.errno, e.errno)}"
    return "allowed"


def _seals(rank: int, client) -> None:
    if rank == 1:
        # Rank 0's host record (topology.py) names its pid and board descriptor.
        record = json.loads(client.blocking_key_value_get("herring_jax/1/host/0", 60_000))
        fd = _pidfd_getfd(record["pid"], record["board"])
        size = os.fstat(fd).st_size
        outcome = {
            "shrink": _refused(lambda: os.ftruncate(fd, 0)),
            "grow": _refused(lambda: os.ftruncate(fd, 2 * size)),
            "map_writable": _refused(lambda: mmap.mmap(fd, size, mmap.MAP_SHARED,
                                                       mmap.PROT_READ | mmap.PROT_WRITE)),
        }
        os.close(fd)
        common.report("seals", all(v == "refused" for v in outcome.values()), **outcome)
        client.key_value_set("seals/tried", "1")
    else:
        client.blocking_key_value_get("seals/tried", 60_000)
    _reduce_once(rank, herring_jax.process_count(), 4097, 0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["reduce", "seals", "ptrace", "freeze"])
    parser.add_argument("--freeze-s", type=float, default=6.0)
    parser.add_argument("--late-s", type=float, default=4.0)
    parser.add_argument("--count", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("--stagger", action="append", default=[])
    args = parser.parse_args()
    _apply_env(args.env)
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    client = jax_compat.distributed_client()
    if args.case == "ptrace":
        from herring_jax._src.process import topology
        common.report("ptrace", True, parent=os.getppid(), describe=herring_jax.describe(),
                      declared=topology.declared_ptracer())
        _reduce_once(rank, nproc, 4097, 0)
        client.wait_at_barrier("fault_worker/reduced", 120_000)
        herring_jax.shutdown()
        common.report("after-shutdown", True, declared=topology.declared_ptracer())
        sys.stdout.flush()
        return 0
    if args.case == "freeze":
        herring_jax.allreduce(np.ones(16, np.float32))
        client.wait_at_barrier("fault_worker/warm", 120_000)
        if rank == 0:
            record = json.loads(client.blocking_key_value_get("herring_jax/1/host/1", 60_000))
            os.kill(record["pid"], signal.SIGSTOP)
            time.sleep(args.freeze_s)
            os.kill(record["pid"], signal.SIGCONT)
            client.key_value_set("fault_worker/thawed", "1")
            # Time for rank 1's threads to run again (a tick of its
            # heartbeats) before this reduction's peer watch looks at it.
            time.sleep(1.5)
        else:
            client.blocking_key_value_get("fault_worker/thawed", 120_000)
            time.sleep(args.late_s)
        _reduce_once(rank, nproc, 4097, 1)
    elif args.case == "seals":
        _seals(rank, client)
    else:
        client.wait_at_barrier("fault_worker/start", 120_000)
        for s in args.stagger:
            who, _, seconds = s.partition(":")
            if int(who) == rank:
                time.sleep(float(seconds))
        for salt in range(args.rounds):
            _reduce_once(rank, nproc, args.count, salt)
    common.report("stats", True, stats=herring_jax.stats(), describe=herring_jax.describe())
    # Every rank stays (its heartbeats and aborts go on) until all have
    # reported; rank 0, which hosts jax.distributed's coordinator, leaves last
    # (the job may be broken: no shutdown barrier).
    client.key_value_set(f"fault_worker/done/{rank}", "1")
    for r in range(nproc):
        client.blocking_key_value_get(f"fault_worker/done/{r}", 300_000)
    if rank == 0:
        time.sleep(1.0)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
