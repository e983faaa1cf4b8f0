"""The worker of `herring-jax bench`: runs in each process, times every peer
on the same buffers in the same order, collective by collective, checks the
result of every run, and rank 0 gathers everything and reports it (report.py)."""

from __future__ import annotations

import argparse
import json
import resource
import os
import sys
import time

import numpy as np

from herring_jax._src.tools.bench import collectives as coll
from herring_jax._src.tools.bench.collectives import pattern as pattern
from herring_jax._src.tools.bench.peers import PEERS
from herring_jax._src.tools.bench.peers.base import KV_PREFIX, KV_TIMEOUT_MS
from herring_jax._src.tools.bench.report import PROCESS_RECORD, cases


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="herring-jax bench --worker", allow_abbrev=False)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--sizes-mib", default="1,16,64")
    p.add_argument("--collective", default="allreduce", help="comma list, see collectives.py")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peers", default="herring,jax_psum")
    p.add_argument("--link-gbps", type=float, default=None)
    p.add_argument("--link-source", default="--link-gbps")
    p.add_argument("--bound-kind", default="link", choices=("link", "memory"))
    p.add_argument("--processes-per-host", type=int, default=1)
    p.add_argument("--server-model", default=None,
                   help="JSON: the servers' layout for the all-reduce's bound (driver.py)")
    p.add_argument("--json", default=None)
    p.add_argument("--missing", default="{}", help="JSON: peers that could not run, and why")
    return p


def mismatch(got: np.ndarray, expected: np.ndarray) -> str | None:
    """None if got == expected exactly, else what is wrong, briefly."""
    got = np.asarray(got)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"got {got.dtype}{list(got.shape)}, expected {expected.dtype}{list(expected.shape)}"
    got, expected = got.reshape(-1), expected.reshape(-1)
    bad = np.flatnonzero(got != expected)  # NaN != NaN: a NaN is wrong too
    if bad.size == 0:
        return None
    i = bad[0]
    return (f"{bad.size} of {expected.size} values wrong, the first at [{i}]: got {got[i]}, "
            f"expected {expected[i]}")


def measure(peer, local, expected, iters: int, warmup: int,
            barrier=None) -> tuple[list[float], list[dict]]:
    """Runs peer `warmup` times, then `iters` timed times; checks every run.

    A wrong result in any run counts, not only in the last: a reduction that
    is right once and wrong the next time (a reused buffer, a race) is the
    kind of bug a benchmark runs into first.

    `barrier(k)`, when given, runs before timed run k, untimed: every rank
    then starts the run together, so no rank's time includes waiting for a
    rank still checking the previous result (as collective benchmarks such
    as the OSU suite and nccl-tests line ranks up before they time).

    Returns:
      (the seconds of each timed run, one {"run": "timed run 2 of 10",
      "what": ...} per run whose result was wrong).
    """
    peer.prepare(local)
    wrong = []

    def check(out, run: str) -> None:
        # Before the next run: in-place peers overwrite their output.
        what = mismatch(peer.result(out), expected)
        if what is not None:
            wrong.append({"run": run, "what": what})

    for k in range(warmup):  # the first call compiles
        peer.reset()
        check(peer.run(), f"warm-up run {k + 1} of {warmup}")
    times = []
    for k in range(iters):
        peer.reset()
        if barrier is not None:
            barrier(k)
        start = time.perf_counter()
        out = peer.run()
        times.append(time.perf_counter() - start)
        check(out, f"timed run {k + 1} of {iters}")  # after the clock stopped
    return times, wrong


def worker_main(argv: list[str] | None = None) -> int:
    """Runs in each process: times every peer, rank 0 prints and saves.

    Args:
      argv: worker arguments (default sys.argv[1:]); see worker_parser.

    Returns:
      0, or 3 on rank 0 when any run of any peer on any rank got a wrong sum.
    """
    return run_worker(worker_parser().parse_args(sys.argv[1:] if argv is None else argv))


def stage_hosts(n: int) -> list[list[int]]:
    """The ranks whose sum crosses the network as one contribution: each
    host's where the host stage runs (every host with the same number of
    processes, all readable), else each process's."""
    from herring_jax._src.process import knobs
    from herring_jax._src.process import runtime

    topology = runtime.state().topology
    hosts: dict[int, list[int]] = {}
    for r, h in enumerate(topology.host_of):
        hosts.setdefault(h, []).append(r)
    groups = list(hosts.values())
    if (knobs.get("HERRING_HOST_STAGE") and all(topology.memory_shared)
            and len({len(g) for g in groups}) == 1):
        return groups
    return [[r] for r in range(n)]


def _groups(plan):
    """(collective, mib, [peer, ...]) for each run of equal collective and size in plan."""
    groups = []
    for collective, mib, name in plan:
        if not groups or groups[-1][:2] != (collective, mib):
            groups.append((collective, mib, []))
        groups[-1][2].append(name)
    return groups


def run_worker(args: argparse.Namespace) -> int:
    """worker_main with parsed arguments."""
    from herring_jax._src.tools.bench import report

    names = [p for p in args.peers.split(",") if p]
    unknown = [p for p in names if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    sizes = [float(s) for s in args.sizes_mib.split(",") if s]
    if "OMPI_COMM_WORLD_RANK" in os.environ:  # started by mpirun
        os.environ.setdefault("HERRING_PROCESS_ID", os.environ["OMPI_COMM_WORLD_RANK"])
        logs, mpi_rank = os.environ.get("HERRING_BENCH_LOGDIR"), os.environ["OMPI_COMM_WORLD_RANK"]
        if logs and mpi_rank != "0":
            fd = os.open(os.path.join(logs, f"rank{mpi_rank}.log"),
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
    for name in names:
        PEERS[name].configure()
    import jax
    import herring_jax
    from herring_jax._src.process import jax_compat

    herring_jax.initialize()
    rank, n = herring_jax.process_index(), herring_jax.process_count()
    peers = {name: PEERS[name](rank, n) for name in names}
    # jax.distributed's coordinator lines the ranks up before each timed run
    # and gathers the figures (its key-value store, not an all-reduce):
    # neither depends on the code under test.
    client = jax_compat.distributed_client()
    records, done = [], 0
    total = len(cases(args.collective, sizes, names))
    # Same collectives, sizes and peers in the same order on every rank: every
    # library needs collectives issued in one order everywhere.
    for collective, mib, names_here in _groups(cases(args.collective, sizes, names)):
        count = coll.elements(mib, collective, n)
        local = coll.local_input(collective, count, rank, n)
        exact = coll.expected(collective, count, rank, n)
        for name in names_here:
            peer = peers[name]
            peer.use(collective)
            want = exact
            if getattr(peer, "codec", "none") != "none":  # herring with a codec: the numpy model
                want = peer.expected(collective, count, rank, n, stage_hosts(n))
            before = herring_jax.stats()
            times, wrong = measure(
                peer, local, want, args.iters, args.warmup,
                barrier=lambda k, key=f"{KV_PREFIX}/{collective}/{name}/{mib}": (
                    client.wait_at_barrier(f"{key}/{k}", KV_TIMEOUT_MS)))
            after = herring_jax.stats()
            for w in wrong:  # at once too, in case the job never gets to its report
                print(f"rank {rank}: {report.wrong_line(name, mib, rank, w, collective)}",
                      file=sys.stderr, flush=True)
            record = {"collective": collective, "mib": mib, "peer": name, "times": times,
                      "correct": not wrong, "wrong_runs": wrong}
            if name.startswith("herring"):
                # What this rank's transport sent per collective (heartbeats
                # included; the host stage's memory reads are not messages).
                runs = args.iters + args.warmup
                record["messages_per_run"] = (after["messages_sent"]
                                              - before["messages_sent"]) / runs
                record["bytes_sent_per_run"] = (after["bytes_sent"] - before["bytes_sent"]) / runs
            records.append(record)
            if rank == 0:  # progress while it runs; the table (every rank's) comes last
                done += 1
                print(f"[{done}/{total}] {collective} {mib:g} MiB {name}: rank 0's median "
                      f"{np.median(times) * 1e3:.2f} ms over {len(times)} runs"
                      f"{', WRONG results' if wrong else ''}", flush=True)
            del want
        del local, exact
    # The last entry: this process's peak memory (every peer's buffers and
    # libraries, not herring's alone).
    records.append({"peer": PROCESS_RECORD,
                    "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    client.key_value_set(f"{KV_PREFIX}/{rank}", json.dumps(records))
    code = 0
    if rank == 0:
        per_rank = [json.loads(client.blocking_key_value_get(f"{KV_PREFIX}/{r}", KV_TIMEOUT_MS))
                    for r in range(n)]
        result = report.report(args, n, sizes, names, per_rank, herring_jax.describe(), jax)
        code = 0 if all(r["correct"] for r in result["results"]) else 3
    herring_jax.shutdown()
    return code
