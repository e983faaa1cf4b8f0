"""Times herring's psum_scatter, all_gather and psum against jax.lax's on the
same devices, for the GPU check's report (tests/gpu/halves_checks.py; no
target, no assertion on time). Usage: halves_timing_worker.py --mib 1,16.

Each operation runs inside one jax.shard_map over one device per process,
float32, tiled, the same program but for the collective; median of --reps
timed calls (each waited for) after two untimed ones. herring's go first, all
sizes, then lax's: on one GPU shared by two processes XLA's collectives go to
NCCL, which may refuse two ranks on one GPU; that error is reported, and
herring's times stand. Also timed, in this process alone: a device-to-host
and a host-to-device copy of each size (the staging's own cost on a GPU).

Reports, per size: herring_<op>_ms, lax_<op>_ms (or lax_error), copy_ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

OPS = ("psum_scatter", "all_gather", "psum")


def timed(fn, x, reps: int) -> float:
    """Median milliseconds of fn(x), waited for."""
    for _ in range(2):
        jax.block_until_ready(fn(x))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def program(lib, op: str, mesh):
    def body(v):
        if op == "psum_scatter":
            return lib.psum_scatter(v[0], "d", tiled=True)[None]
        if op == "all_gather":
            return lib.all_gather(v[0], "d", tiled=True)[None]
        return lib.psum(v[0], "d")[None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))


def copy_ms(host: np.ndarray, reps: int) -> float:
    """Median milliseconds of a host-to-device and a device-to-host copy of
    `host` (a fresh device array each time: nothing cached)."""
    device = jax.local_devices()[0]

    def both_ways(h):
        return np.asarray(jax.block_until_ready(jax.device_put(h, device)))

    return timed(both_ways, host, reps)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", default="1,16")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        # lax across processes on CPU devices: gloo (the dry run only). Set
        # before the backend starts, which herring_jax.initialize() does.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    herring_jax.initialize()
    n, rank = jax.process_count(), jax.process_index()
    mesh = jax.make_mesh((n,), ("d",))
    sharding = NamedSharding(mesh, P("d"))

    def operand(count):
        local = common.make_input("float32", count, rank, 1)
        return local, jax.make_array_from_process_local_data(sharding, local[None], (n, count))

    rows = {}
    for mib in [float(m) for m in args.mib.split(",")]:
        count = int(mib * (1 << 20)) // 4 // n * n  # float32, a multiple of N
        local, x = operand(count)
        row = rows[mib] = {"bytes": count * 4}
        for op in OPS:
            row[f"herring_{op}_ms"] = round(timed(program(herring_jax, op, mesh), x, args.reps), 3)
        row["copy_ms"] = round(copy_ms(local, args.reps), 3)
    lax_error = None
    for mib, row in rows.items():
        if lax_error is None:
            _, x = operand(row["bytes"] // 4)
            try:
                for op in OPS:
                    row[f"lax_{op}_ms"] = round(timed(program(jax.lax, op, mesh), x, args.reps),
                                                3)
            except Exception as e:  # NCCL refusing two ranks on one GPU, reported as such
                lax_error = f"{type(e).__name__}: {str(e)[:300]}"
                row["lax_error"] = lax_error
        else:
            row["lax_error"] = "not run after the first error"
        common.report(f"timing-{mib:g}MiB", True, **row)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
