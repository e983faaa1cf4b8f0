"""Soak: many reductions of random sizes, dtypes and ops, every one checked.

  soak_worker.py --buffers N --sizes K --seed S

Every rank draws the same sequence of (dtype, element count, op, eager or
jitted) from the seed: first one pass over every combination (the warm-up,
which compiles each shape once), then N random buffers. Rank 0 compares each
result bitwise with the numpy rank-order reference; every rank folds its
results into a running digest, and the test requires all ranks' digests to
match rank 0's, so every rank's every result is checked. VmRSS is reported at
start, after the warm-up and at the end: after the warm-up nothing new is
compiled, so memory must stay flat.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import common
import jax
import numpy as np

import herring_jax

MAX_BYTES = 8 << 20


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def combos(n_sizes: int) -> list[tuple[str, int, str]]:
    out = []
    for dtype, np_dtype in common.NP_DTYPES.items():
        top = MAX_BYTES // np_dtype.itemsize
        counts = sorted({int(c) for c in np.geomspace(1, top, n_sizes).round()})
        for count in counts:
            for op in ("sum", "mean") if not dtype.startswith("int") else ("sum",):
                out.append((dtype, count, op))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--buffers", type=int, required=True)
    parser.add_argument("--sizes", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)  # float64 and int64 stay 64-bit
    herring_jax.initialize()
    rank, n = herring_jax.process_index(), herring_jax.process_count()
    jitted = jax.jit(herring_jax.allreduce, static_argnames=("op",))
    table = combos(args.sizes)
    rng = np.random.default_rng(args.seed)  # the same on every rank
    plan = list(range(len(table))) + list(rng.integers(0, len(table), size=args.buffers))
    rss = {"start": rss_mib()}
    running = hashlib.sha256()
    mismatches, total_bytes = [], 0
    start = time.monotonic()
    for i, which in enumerate(plan):
        if i == len(table):
            rss["after_warmup"] = rss_mib()
        dtype, count, op = table[which]
        x = common.make_input(dtype, count, rank, salt=i)
        # Even combinations go through a user's jit, odd ones eager.
        out = np.asarray(jitted(x, op=op) if which % 2 == 0 else herring_jax.allreduce(x, op))
        running.update(out.tobytes())
        total_bytes += out.nbytes
        if rank == 0:
            inputs = [[common.make_input(dtype, count, r, salt=i)] for r in range(n)]
            want = common.reference(dtype, op, inputs, common.hosts_from_env(n))
            if not common.bitwise_equal(out, want):
                mismatches.append([i, dtype, count, op])
        if rank == 0 and (i + 1) % 500 == 0:
            print(f"soak: {i + 1}/{len(plan)} buffers, {total_bytes / 2**20:.0f} MiB, "
                  f"{time.monotonic() - start:.0f} s, RSS {rss_mib():.0f} MiB", flush=True)
    rss["end"] = rss_mib()
    common.report("soak", not mismatches, buffers=len(plan) - len(table), warmup=len(table),
                  bytes=total_bytes, digest=running.hexdigest()[:16],
                  mismatches=mismatches[:20], rss_mib=rss, seconds=time.monotonic() - start)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
