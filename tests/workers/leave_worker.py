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
  --stop-rank R --stop-s S --stop-at during|after
                          rank R is stopped (SIGSTOP) for S seconds: `during`
                          a random 0..0.2 s into its last reduction (it may
                          have sent its part and not yet taken in the
                          others': they finish and leave while it sleeps),
                          `after` it returned (before the others' kLeave
                          reaches it: they wait for its receipt).
  --exit-delay-s D        every rank but the stopped one waits D s after its
                          last reduction before it exits.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402


def stop_me(after_s: float, for_s: float) -> None:
    """Has a helper stop this whole process (every thread: the transport's
    progress too) `after_s` from now, for `for_s` seconds."""
    pid = os.getpid()
    subprocess.Popen(["sh", "-c", f"sleep {after_s}; kill -STOP {pid}; sleep {for_s}; "
                      f"kill -CONT {pid}"])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--count", type=int, default=300_000)
    parser.add_argument("--lag-rank", type=int, default=-1)
    parser.add_argument("--lag-s", type=float, default=0.0)
    parser.add_argument("--fewer-rank", type=int, default=-1)
    parser.add_argument("--jitter-s", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-rank", type=int, default=-1)
    parser.add_argument("--stop-s", type=float, default=0.0)
    parser.add_argument("--stop-at", choices=("during", "after"), default="during")
    parser.add_argument("--exit-delay-s", type=float, default=0.0)
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
        if last and rank == args.stop_rank and args.stop_at == "during":
            stop_me(rng.uniform(0, 0.2), args.stop_s)
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
    if rank == args.stop_rank and args.stop_at == "after":
        stop_me(0, args.stop_s)
        time.sleep(args.stop_s + 0.5)  # stopped meanwhile; its exit follows
    elif args.exit_delay_s > 0:
        time.sleep(args.exit_delay_s)
    if args.jitter_s > 0:
        time.sleep(rng.uniform(0, args.jitter_s))
    common.report("leave", True, steps=steps)
    sys.stdout.flush()
    return 0  # the exit handler (herring_jax.shutdown) runs from here on


if __name__ == "__main__":
    sys.exit(main())
