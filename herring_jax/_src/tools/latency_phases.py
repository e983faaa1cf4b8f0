"""Where a small all-reduce's time goes, phase by phase, on N local processes:

  herring-jax launch -n 4 -- python3 -m herring_jax._src.tools.latency_phases --count 1
  HERRING_HOST_DIRECT_BYTES=0 herring-jax launch -n 2 -- python3 -m herring_jax._src.tools.latency_phases

Each timed run starts from jax.distributed's barrier, as `herring-jax bench`
times its runs; the engine's timeline (runtime.take_timeline) says when XLA
issued the reduction, when herring's thread took it up and when it ended.
Rank 0 prints the medians over the runs, in microseconds:

  skew        the last process's barrier exit after the first's
  dispatch    from the barrier's exit to XLA issuing the custom call
  hop         from the issue to herring's thread taking it up
  first/last  from the last process taking it up to the first/last ending:
              the reduction itself once every process is in it
  ready       from the end to block_until_ready returning in Python
  total       barrier exit to result, per process
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=16384, help="float32 elements")
    parser.add_argument("--iters", type=int, default=200, help="timed runs")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import herring_jax
    from herring_jax._src.process import jax_compat
    from herring_jax._src.process import runtime

    herring_jax.initialize()
    rank = herring_jax.process_index()
    client = jax_compat.distributed_client()
    x = jnp.asarray(np.full(args.count, rank + 1, np.float32))
    reduce = jax.jit(herring_jax.allreduce)
    for _ in range(10):
        reduce(x).block_until_ready()
    runtime.take_timeline()
    rows = []
    for k in range(args.iters):
        client.wait_at_barrier(f"latency_phases/{k}", 60_000)
        start = time.monotonic_ns()
        reduce(x).block_until_ready()
        ready = time.monotonic_ns()
        [event] = runtime.take_timeline()
        rows.append((start, event["issued_ns"], event["begun_ns"], event["ended_ns"], ready))
    # (processes, runs, 5): every process's stamps (one machine, one clock).
    stamps = np.asarray(herring_jax.allgather(np.asarray(rows, np.int64)))
    if rank == 0:
        start, issued, begun, ended, ready = (stamps[..., i] for i in range(5))
        us = lambda v: float(np.median(v)) / 1e3  # noqa: E731
        last_begun = begun.max(0)
        print(f"{herring_jax.process_count()} processes, {args.count * 4} bytes, "
              f"{args.iters} runs (median us): skew {us(start.max(0) - start.min(0)):.0f} | "
              f"dispatch {us(issued - start):.0f} | hop {us(begun - issued):.0f} | "
              f"after the last took it up: first end {us(ended.min(0) - last_begun):.0f}, "
              f"last end {us(ended.max(0) - last_begun):.0f} | ready {us(ready - ended):.0f} | "
              f"total {us(ready - start):.0f}", flush=True)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
