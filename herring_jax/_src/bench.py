"""herring-jax bench: all-reduce time of herring_jax against its peers, measured
in the same invocation on the same buffers.

  herring-jax bench -n 4 [--sizes-mib 1,16,64,256] [--iters 10] [--json out.json]
  python -m herring_jax.bench -n 4 ...

Peers measured now: jax.lax.psum across processes (JAX's gloo CPU
collectives). Every result is checked; the table gives the median and minimum
time over --iters runs after --warmup runs, algorithmic bandwidth (bytes /
time), bus bandwidth (algbw * 2(n-1)/n), the speed-up of herring over each
peer, and a bound: the fewest seconds the parameter-server algorithm needs
when each process moves 2(n-1)/n * bytes over a link of the transport's
point-to-point bandwidth, measured here with fi_pingpong (or given with
--link-gbps).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

PEERS = ("herring", "jax_psum")
_RESULT = "HERRING_BENCH "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--num-processes", type=int, default=4)
    parser.add_argument("--sizes-mib", default="1,16,64,256",
                        help="comma-separated buffer sizes in MiB (float32)")
    parser.add_argument("--iters", type=int, default=10, help="timed runs per size and peer")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated subset of {', '.join(PEERS)}")
    parser.add_argument("--provider", default=None,
                        help="libfabric provider for herring (sets HERRING_FI_PROVIDER)")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="link bandwidth for the bound in GB/s (default: fi_pingpong)")
    parser.add_argument("--json", default=None, help="write every timing to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=1800)


# -- worker (runs in each process) -------------------------------------------

def _worker(args) -> int:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import herring_jax

    herring_jax.initialize()
    rank, n = herring_jax.process_index(), herring_jax.process_count()
    mesh = jax.sharding.Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index)),
                             ("p",))
    peers = [p for p in args.peers.split(",") if p]
    herring_fn = jax.jit(lambda v: herring_jax.allreduce(v))
    psum_fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "p"), mesh=mesh,
                                    in_specs=P("p"), out_specs=P("p")))
    expected = n * (n + 1) / 2  # every rank contributes rank + 1
    for mib in [float(s) for s in args.sizes_mib.split(",") if s]:
        count = int(mib * 2**20) // 4
        local = np.full((count,), rank + 1, np.float32)
        for peer in peers:
            if peer == "herring":
                fn, arg = herring_fn, jnp.asarray(local)
            elif peer == "jax_psum":
                fn = psum_fn
                arg = jax.make_array_from_process_local_data(NamedSharding(mesh, P("p")), local)
            else:
                raise SystemExit(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
            for _ in range(args.warmup):
                out = jax.block_until_ready(fn(arg))
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                out = jax.block_until_ready(fn(arg))
                times.append(time.perf_counter() - start)
            shard = np.asarray(out.addressable_shards[0].data)
            correct = bool(np.all(shard == expected))
            print(_RESULT + json.dumps({"rank": rank, "n": n, "mib": mib, "peer": peer,
                                        "times": times, "correct": correct}), flush=True)
            del out, arg
    if rank == 0:
        print(_RESULT + json.dumps({"describe": herring_jax.describe()}), flush=True)
    herring_jax.shutdown()
    return 0


# -- driver ------------------------------------------------------------------

def _pingpong_gbps(provider: str | None) -> tuple[float | None, str]:
    """One-way bandwidth of 4 MiB tagged messages between two local processes."""
    tool = shutil.which("fi_pingpong")
    prov = provider or "tcp;ofi_rxm"
    if tool is None:
        return None, "fi_pingpong not found (apt-get install libfabric-bin)"
    port = 47000 + os.getpid() % 1000
    common = [tool, "-p", prov, "-e", "rdm", "-I", "50", "-S", str(4 << 20)]
    try:
        server = subprocess.Popen(common + ["-B", str(port)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        out = subprocess.run(common + ["-P", str(port), "127.0.0.1"], capture_output=True,
                             text=True, timeout=60).stdout
        server.wait(timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"fi_pingpong failed: {e}"
    m = re.search(r"^\s*4m\s+\d+\s+=\d+\s+\S+\s+\S+\s+([\d.]+)", out, re.M)
    if not m:
        return None, f"fi_pingpong -p {prov} gave no figure"
    return float(m.group(1)) * 1e6 / 1e9, f"fi_pingpong -p '{prov}' -e rdm -S 4m, same machine"


def _table(results, n, link_gbps):
    rows = []
    by = {(r["mib"], r["peer"]): r for r in results}
    header = (f"{'size MiB':>8} {'peer':>9} {'median ms':>10} {'min ms':>8} {'algbw GB/s':>10} "
              f"{'busbw GB/s':>10} {'herring x':>10} {'bound ms':>9} {'ok':>3}")
    rows.append(header)
    for mib in sorted({m for m, _ in by}):
        herring = by.get((mib, "herring"))
        for peer in PEERS:
            r = by.get((mib, peer))
            if r is None:
                continue
            nbytes = mib * 2**20
            algbw = nbytes / r["median_s"] / 1e9
            busbw = algbw * 2 * (n - 1) / n
            speedup = (f"{r['median_s'] / herring['median_s']:.2f}" if herring else "-")
            bound = (f"{2 * (n - 1) / n * nbytes / (link_gbps * 1e9) * 1e3:.1f}"
                     if link_gbps else "-")
            rows.append(f"{mib:>8g} {peer:>9} {r['median_s'] * 1e3:>10.1f} "
                        f"{r['min_s'] * 1e3:>8.1f} {algbw:>10.3f} {busbw:>10.3f} "
                        f"{speedup:>10} {bound:>9} {'yes' if r['correct'] else 'NO':>3}")
    return "\n".join(rows)


def run(args) -> int:
    if args.worker:
        return _worker(args)

    env = dict(os.environ)
    if args.provider:
        env["HERRING_FI_PROVIDER"] = args.provider
    link_gbps, link_source = ((args.link_gbps, "--link-gbps") if args.link_gbps
                              else _pingpong_gbps(args.provider or env.get("HERRING_FI_PROVIDER")))
    cmd = [sys.executable, "-m", "herring_jax.bench", "--worker", "--sizes-mib", args.sizes_mib,
           "--iters", str(args.iters), "--warmup", str(args.warmup), "--peers", args.peers]
    print(f"herring-jax bench: {args.num_processes} processes, sizes {args.sizes_mib} MiB, "
          f"{args.iters} timed runs after {args.warmup} warm-up, peers {args.peers}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "herring_jax.launch", "-n", str(args.num_processes),
             "--timeout", str(args.timeout), "--", *cmd],
            env=env, cwd=tmp, capture_output=True, text=True)
    lines = [l.split(_RESULT, 1)[1] for l in proc.stdout.splitlines() if _RESULT in l]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
        print(f"herring-jax bench: workers failed (exit {proc.returncode})", file=sys.stderr)
        return proc.returncode or 1
    records = [json.loads(l) for l in lines]
    describe = next((r["describe"] for r in records if "describe" in r), "?")
    samples = [r for r in records if "peer" in r]
    results = []
    for key in sorted({(r["mib"], r["peer"]) for r in samples}):
        per_rank = [r for r in samples if (r["mib"], r["peer"]) == key]
        # An iteration ends for the job when its slowest rank ends.
        iters = [max(r["times"][i] for r in per_rank) for i in range(len(per_rank[0]["times"]))]
        iters.sort()
        results.append({"mib": key[0], "peer": key[1], "median_s": iters[len(iters) // 2],
                        "min_s": iters[0], "max_s": iters[-1], "times_s": iters,
                        "correct": all(r["correct"] for r in per_rank)})
    n = args.num_processes
    print(f"transport: {describe}")
    print(f"bound: 2(n-1)/n * bytes / link, link = "
          f"{f'{link_gbps:.2f} GB/s' if link_gbps else 'unknown'} ({link_source})")
    print(_table(results, n, link_gbps), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": n, "transport": describe, "link_gbps": link_gbps,
                       "link_source": link_source, "results": results,
                       "host": platform.node(), "cpus": os.cpu_count(),
                       "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "jax": _jax_version()}, f, indent=1)
    return 0 if all(r["correct"] for r in results) else 3


def _jax_version() -> str:
    import jax
    return jax.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="herring-jax bench",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
