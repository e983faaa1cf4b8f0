"""allreduce_gradients(compression=...) with error feedback, checked step by
step against the numpy model on every rank: each step's update is the
engine's compressed mean of the processes' gradients plus their residuals,
and the new residual is exactly what this process's contribution lost.

Usage (under the launcher, host stage off so that each process's fusion
buffer is what crosses the wire):
  python tests/workers/ef_worker.py --codec int8 [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.collectives import codecs  # noqa: E402

SIZE = 5000  # one leaf: one fusion buffer, its codec blocks from element 0


def grads(rank: int, step: int) -> np.ndarray:
    return common.make_input("float32", SIZE, rank, step)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()

    tx = herring_jax.allreduce_gradients(compression=args.codec)
    # A bfloat16 leaf travels exactly and keeps no residual.
    params = {"w": jnp.zeros(SIZE, jnp.float32), "b": jnp.zeros(10, jnp.bfloat16)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    residuals = [np.zeros(SIZE, np.float32) for _ in range(nproc)]
    ok = True
    for step in range(args.steps):
        g = {"w": jnp.asarray(grads(rank, step)), "b": jnp.full(10, rank + 1, jnp.bfloat16)}
        out, state = update(g, state, params)
        # The model: every process's contribution is its gradient plus its
        # residual; the residual becomes what encoding that sum lost.
        sent = [grads(r, step) + residuals[r] for r in range(nproc)]
        want = codecs.reduce_np(args.codec, "mean", sent, nproc)
        residuals = [p - codecs.roundtrip_np(args.codec, p) for p in sent]
        got_w = np.asarray(out["w"])
        got_e = np.asarray(state.residual["w"])
        residual_ok = common.bitwise_equal(got_e, residuals[rank])
        step_ok = (common.bitwise_equal(got_w, want) and residual_ok
                   and np.all(np.asarray(out["b"], np.float32) == (nproc + 1) / 2)
                   and state.residual["b"].shape == ()
                   and np.any(got_e != 0))
        ok = ok and step_ok
        common.report(f"step{step}", step_ok, digest=common.digest(got_w),
                      out_ok=common.bitwise_equal(got_w, want),
                      residual_ok=residual_ok,
                      residual_norm=float(np.linalg.norm(got_e)))
    common.report("ef", ok)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
