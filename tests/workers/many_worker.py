"""50 reductions of mixed shapes, dtypes and ops in one jitted function,
checked bitwise against the numpy rank-order reference on rank 0 and by digest
across ranks."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

DTYPES = ["float32", "bfloat16", "float16", "int32", "float64", "int64"]


def main() -> int:
    jax.config.update("jax_enable_x64", True)
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    specs = []
    for i in range(50):
        dtype = DTYPES[i % len(DTYPES)]
        op = "mean" if (i % 3 == 0 and not dtype.startswith("int")) else "sum"
        count = [1, 7, 33, 1000, 4097, 70000][i % 6] + i
        specs.append((dtype, op, count))

    @jax.jit
    def step(xs):
        # One allreduce call per leaf: 50 custom calls with 50 distinct keys.
        return [herring_jax.allreduce(x, op=op) for x, (_, op, _) in zip(xs, specs)]

    xs = [common.make_input(d, c, rank, salt) for salt, (d, _, c) in enumerate(specs)]
    for repeat in range(2):  # the second run reuses the compiled executable
        outs = [np.asarray(o) for o in step(xs)]
        for salt, ((dtype, op, count), got) in enumerate(zip(specs, outs)):
            ok = got.dtype == common.NP_DTYPES[dtype] and got.shape == (count,)
            if rank == 0:
                inputs = [[common.make_input(dtype, count, p, salt)] for p in range(nproc)]
                want = common.reference(dtype, op, inputs, common.hosts_from_env(nproc))
                ok = ok and common.bitwise_equal(got, want)
            common.report(f"{repeat}/{salt}/{dtype}/{op}/{count}", ok, digest=common.digest(got))
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
