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


STOPPER = """
import os, signal, sys, time
pid, after_s, for_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
sys.stdin.readline()
time.sleep(after_s)
os.kill(pid, signal.SIGSTOP)
time.sleep(for_s)
os.kill(pid, signal.SIGCONT)
"""


class Stopper:
    """A helper process, started ahead, that stops this whole process (every
    thread: the transport's progress too) `after_s` after `go()`, for `for_s`
    seconds. Started ahead so that go() acts within a moment, also where
    starting a process is slow (a sanitizer's runtime in every process)."""

    def __init__(self, after_s: float, for_s: float):
        self.proc = subprocess.Popen([sys.executable, "-c", STOPPER, str(os.getpid()),
                                      str(after_s), str(for_s)], stdin=subprocess.PIPE,
                                     text=True)

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


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
    stopper = None
    if rank == args.stop_rank:
        stopper = Stopper(rng.uniform(0, 0.2) if args.stop_at == "during" else 0, args.stop_s)
    want_total = size * (size + 1) // 2
    start = time.monotonic()
    for step in range(steps):
        last = step == args.steps - 1
        if last and rank == args.lag_rank:
            time.sleep(args.lag_s)
        if last and args.jitter_s > 0:
            time.sleep(rng.uniform(0, args.jitter_s))
        if last and stopper and args.stop_at == "during":
            stopper.go()
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
    if stopper and args.stop_at == "after":
        stopper.go()
        time.sleep(args.stop_s + 0.5)  # stopped meanwhile; its exit follows
    elif args.exit_delay_s > 0:
        time.sleep(args.exit_delay_s)
    if args.jitter_s > 0:
        time.sleep(rng.uniform(0, args.jitter_s))
    if stopper:
        stopper.proc.wait()
    common.report("leave", True, steps=steps)
    sys.stdout.flush()
    return 0  # the exit handler (herring_jax.shutdown) runs from here on


if __name__ == "__main__":
    sys.exit(main())
