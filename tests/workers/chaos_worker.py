"""Chaos: reduce in a loop, checking every result, until a peer is killed.

Prints `CHAOS_READY <pid>` once reducing, then loops over reductions of
varying size whose exact sum is known. When a reduction fails it prints
`CHAOS_ERROR <seconds since the last good reduction> <message>` and exits 3;
a wrong sum prints `CHAOS_WRONG` and exits 4.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import herring_jax


def main() -> int:
    herring_jax.initialize()
    rank, n = herring_jax.process_index(), herring_jax.process_count()
    expected = np.float32(n * (n + 1) / 2)
    print(f"CHAOS_READY {os.getpid()}", flush=True)
    last_ok = time.monotonic()
    i = 0
    while True:
        count = 1 + (i * 7919) % (1 << 20)
        try:
            out = np.asarray(herring_jax.allreduce(np.full(count, rank + 1, np.float32)))
        except herring_jax.HerringError as e:
            print(f"CHAOS_ERROR {time.monotonic() - last_ok:.2f} {str(e)[:400]}", flush=True)
            if rank == 0:
                # Rank 0 hosts jax.distributed's coordinator: when it exits,
                # jax terminates the other processes at once, possibly before
                # they print their own HerringError. The test closes stdin
                # once it has collected the other survivors.
                sys.stdin.read()
            os._exit(3)  # the job is broken: skip jax.distributed's shutdown barrier
        if out.shape != (count,) or not np.all(out == expected):
            print(f"CHAOS_WRONG reduction {i}", flush=True)
            os._exit(4)
        last_ok = time.monotonic()
        i += 1


if __name__ == "__main__":
    sys.exit(main())
