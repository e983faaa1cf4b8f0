"""Sparse rows against the dense reduction of one embedding table's gradient.

Run on every process of a job (under `herring-jax launch`); each step every
process touches `--touched` of the table's rows (its own random rows), and
the table's gradient is reduced by allreduce_gradients with and without
sparse_rows (the row ids given, the bound the touched share), alternately,
in one run. Rank 0 prints a Markdown row and a JSON line: the median time of
a reduction step, the bytes this process sent per step (the engine's
``bytes_sent``), their ratios, and whether the two results were bitwise equal.

  herring-jax launch -n 4 --netns --host-rate 1gbit --flow-rate 250mbit -- \\
      python -m herring_jax._src.tools.sparse_bench --rows 131072 --dim 256 --touched 0.02
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import herring_jax


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--touched", type=float, default=0.02,
                        help="share of the rows each process touches per step (and the bound)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None, help="rank 0 appends its JSON line here")
    args = parser.parse_args(argv)
    herring_jax.initialize()
    rank, n = herring_jax.process_index(), herring_jax.process_count()
    k = max(1, math.ceil(args.touched * args.rows))

    def batch(step: int):
        rng = np.random.RandomState(7919 * step + rank)
        ids = np.sort(rng.choice(args.rows, k, replace=False)).astype(np.int32)
        g = np.zeros((args.rows, args.dim), np.float32)
        g[ids] = rng.randn(k, args.dim).astype(np.float32)
        return {"emb": jnp.asarray(g)}, jnp.asarray(ids)

    dense_tx = herring_jax.allreduce_gradients()
    sparse_tx = herring_jax.allreduce_gradients(sparse_rows=lambda path, g: True,
                                                sparse_max_rows=k)
    state = dense_tx.init({"emb": jnp.zeros((1,))})
    dense = jax.jit(lambda g: dense_tx.update(g, state)[0])
    sparse = jax.jit(lambda g, ids: sparse_tx.update(g, state, row_ids=ids)[0])
    runs = {"dense": dense, "sparse": sparse}
    times: dict[str, list[float]] = {"dense": [], "sparse": []}
    sent: dict[str, list[int]] = {"dense": [], "sparse": []}
    equal = True
    for step in range(args.warmup + args.steps):
        g, ids = batch(step)
        jax.block_until_ready((g, ids))
        outs = {}
        for name in ("dense", "sparse") if step % 2 == 0 else ("sparse", "dense"):
            call = (lambda: runs[name](g)) if name == "dense" else (lambda: runs[name](g, ids))
            herring_jax.barrier()
            before = herring_jax.stats()["bytes_sent"]
            start = time.perf_counter()
            outs[name] = jax.block_until_ready(call())
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times[name].append(elapsed)
                sent[name].append(herring_jax.stats()["bytes_sent"] - before)
        equal = equal and (np.asarray(outs["dense"]["emb"]).tobytes()
                           == np.asarray(outs["sparse"]["emb"]).tobytes())
        del outs
    if rank == 0:
        row = {"processes": n, "rows": args.rows, "dim": args.dim, "touched": args.touched,
               "bound_rows": k, "network": os.environ.get("HERRING_BENCH_NETWORK", ""),
               "dense_ms": 1e3 * statistics.median(times["dense"]),
               "sparse_ms": 1e3 * statistics.median(times["sparse"]),
               "dense_bytes_sent": int(statistics.median(sent["dense"])),
               "sparse_bytes_sent": int(statistics.median(sent["sparse"])),
               "bitwise_equal": equal, "steps": args.steps}
        row["time_ratio"] = row["dense_ms"] / row["sparse_ms"]
        row["bytes_ratio"] = row["dense_bytes_sent"] / max(1, row["sparse_bytes_sent"])
        print(f"| {n} | {args.rows} x {args.dim} | {100 * args.touched:g}% ({k} rows) | "
              f"{row['dense_bytes_sent'] / 2**20:.1f} MiB | "
              f"{row['sparse_bytes_sent'] / 2**20:.2f} MiB | {row['bytes_ratio']:.1f}x | "
              f"{row['dense_ms']:.0f} ms | {row['sparse_ms']:.0f} ms | "
              f"{row['time_ratio']:.1f}x | {'yes' if equal else 'NO'} |", flush=True)
        print("SPARSE_BENCH " + json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    herring_jax.shutdown()
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
