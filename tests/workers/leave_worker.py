"""A job's last reductions and its ranks' exits (tests/test_leave.py, the exit soak).

  leave_worker.py --steps N [--count C] [--lag-rank R --lag-s S] [--fewer-rank R]
                  [--jitter-s J --seed K]

Every rank runs N all-reduces of float32[C] (several chunks, so that result
chunks are still on their way when a fast rank's last call returns), checks
each result exactly (small integers: any order sums them exactly) and returns
from main as soon as its own last call has returned: the interpreter's exit
(herring_jax's exit handler) follows at once, while slower ranks may still be
receiving this rank's last messages.

  --lag-rank R --lag-s S  rank R sleeps S seconds before its last reduction:
                          the others have left long before it reduces.
  --fewer-rank R          rank R runs one reduction fewer and exits: the
                          others' last reduction must fail fast, naming it.
  --jitter-s J --seed K   every rank sleeps a random 0..J s (drawn from K and
                          its rank) before its last reduction, and as long
                          after it: ranks leave at different moments.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--count", type=int, default=300_000)
    parser.add_argument("--lag-rank", type=int, default=-1)
    parser.add_argument("--lag-s", type=float, default=0.0)
    parser.add_argument("--fewer-rank", type=int, default=-1)
    parser.add_argument("--jitter-s", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    herring_jax.initialize()
    rank, size = herring_jax.process_index(), herring_jax.process_count()
    rng = random.Random(args.seed * 1000 + rank)
    steps = args.steps - (1 if rank == args.fewer_rank else 0)
    want_total = size * (size + 1) // 2
    start = time.monotonic()
    for step in range(steps):
        last = step == args.steps - 1
        if last and rank == args.lag_rank:
            time.sleep(args.lag_s)
        if last and args.jitter_s > 0:
            time.sleep(rng.uniform(0, args.jitter_s))
        x = np.full(args.count, rank + 1 + step, np.float32)
        try:
            out = np.asarray(herring_jax.allreduce(x))
        except herring_jax.HerringError as e:
            common.report("leave", False, step=step, seconds=time.monotonic() - start,
                          message=str(e)[:1500])
            sys.stdout.flush()
            return 0
        want = want_total + size * step
        if not (out == want).all():
            common.report("leave", False, step=step, message=f"wrong sum {out[:4]} != {want}")
            return 0
        start = time.monotonic()
    if args.jitter_s > 0:
        time.sleep(rng.uniform(0, args.jitter_s))
    common.report("leave", True, steps=steps)
    sys.stdout.flush()
    return 0  # the exit handler (herring_jax.shutdown) runs from here on


if __name__ == "__main__":
    sys.exit(main())
