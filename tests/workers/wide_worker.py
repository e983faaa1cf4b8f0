"""One allreduce of more buffers than a host board's posting holds (which goes
through host-stage messages) next to ordinary ones (through the boards), twice,
in one jitted step; every result checked bitwise against the numpy reference
on every rank, then the engine's counters reported."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

WIDE = 200  # more than HostBoard::kEntries (128)


def main() -> int:
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    specs = [("float32" if i % 2 else "int32", 1 + (i * 37) % 300) for i in range(WIDE)]
    narrow = ("float32", 70000)

    @jax.jit
    def step(wide, one):
        return herring_jax.allreduce(wide), herring_jax.allreduce(one)

    wide = [common.make_input(d, c, rank, salt) for salt, (d, c) in enumerate(specs)]
    one = common.make_input(narrow[0], narrow[1], rank, WIDE)
    hosts = common.hosts_from_env(nproc)
    for repeat in range(2):
        got_wide, got_one = step(wide, one)
        ok = len(got_wide) == WIDE
        for salt, ((dtype, count), got) in enumerate(zip(specs, got_wide)):
            inputs = [[common.make_input(dtype, count, p, salt)] for p in range(nproc)]
            ok = ok and common.bitwise_equal(np.asarray(got),
                                             common.reference(dtype, "sum", inputs, hosts))
        common.report(f"{repeat}/wide", ok)
        inputs = [[common.make_input(narrow[0], narrow[1], p, WIDE)] for p in range(nproc)]
        common.report(f"{repeat}/one", common.bitwise_equal(
            np.asarray(got_one), common.reference(narrow[0], "sum", inputs, hosts)))
    common.report("stats", True, stats=herring_jax.stats())
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
