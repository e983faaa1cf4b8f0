"""Reports the scheduler time slice of each of this process's threads (the
`se.slice` line of /proc/self/task/*/sched, in ns) after one reduction, so
that the test can find the transport's progress thread among them."""

from __future__ import annotations

import glob
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402


def slices() -> list[int]:
    found = []
    for path in glob.glob("/proc/self/task/*/sched"):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("se.slice"):
                        found.append(int(float(line.split(":")[1])))
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return found


def main() -> None:
    herring_jax.initialize()
    out = jax.jit(herring_jax.allreduce)(jnp.ones(1000, jnp.float32))
    ok = bool((out == herring_jax.process_count()).all())
    common.report("slices", ok, slices=slices())


if __name__ == "__main__":
    main()
