"""herring_jax.powersgd on several processes, step by step against a numpy
model (float64; the factors' signs do not matter: the update is P^ P^T M):
the update is the same on every rank, matrices are averaged as rank-r
approximations, small leaves exactly, and the residual is what this
process's matrix missed.

With warmup_steps=W the first W updates average every leaf exactly.

Usage (under the launcher): python tests/workers/powersgd_worker.py [--steps 3] [--warmups 0,1]
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

SHAPES = {"w": (64, 6, 8), "b": (48,), "tiny": (2, 2)}
RANK = 2


def grads(rank: int, step: int) -> dict:
    return common.make_tree(SHAPES, rank, step)


def check(tx_warmup: int, steps: int, rank: int, nproc: int) -> bool:
    """Runs `steps` updates of powersgd(warmup_steps=tx_warmup); reports
    each step against the model."""
    tx = herring_jax.powersgd(rank=RANK, warmup_steps=tx_warmup)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    state = tx.init(params)
    assert state.q["w"].shape == (48, RANK) and state.q["b"].shape == ()
    update = jax.jit(tx.update)
    residuals = [np.zeros((64, 48)) for _ in range(nproc)]
    q = np.asarray(state.q["w"], np.float64)
    q0 = np.asarray(state.q["w"])
    ok = True
    for step in range(steps):
        out, state = update({k: jnp.asarray(v) for k, v in grads(rank, step).items()}, state)
        every = [grads(r, step) for r in range(nproc)]
        exact_ok = all(np.allclose(np.asarray(out[k]), np.mean([e[k] for e in every], axis=0),
                                   rtol=1e-6, atol=0) for k in ("b", "tiny"))
        if step < tx_warmup:
            # Warm-up: every leaf averaged exactly; Q and the residual untouched.
            want = np.mean([e["w"] for e in every], axis=0).reshape(64, 48)
            got = np.asarray(out["w"]).reshape(64, 48)
            w_ok = np.allclose(got, want, rtol=1e-6, atol=0)
            e_ok = (not np.asarray(state.residual["w"]).any()
                    and np.array_equal(np.asarray(state.q["w"]), q0))
        else:
            ms = [e["w"].reshape(64, 48).astype(np.float64) + residuals[r]
                  for r, e in enumerate(every)]
            p = np.mean([m @ q for m in ms], axis=0)
            p_hat = np.linalg.qr(p)[0]
            q = np.mean([m.T @ p_hat for m in ms], axis=0)
            want = p_hat @ q.T
            residuals = [m - want for m in ms]
            got = np.asarray(out["w"]).reshape(64, 48)
            scale = np.abs(want).max()
            w_ok = np.allclose(got, want, rtol=0, atol=1e-4 * scale)
            e_ok = np.allclose(np.asarray(state.residual["w"]).reshape(64, 48),
                               residuals[rank], rtol=0, atol=1e-4 * scale)
            # The warm start carries over: keep the model's Q in the sign basis jax chose.
            q = np.asarray(state.q["w"], np.float64)
        count_ok = int(state.count) == min(step + 1, tx_warmup)
        step_ok = bool(w_ok and e_ok and exact_ok and count_ok)
        ok = ok and step_ok
        common.report(f"warmup{tx_warmup}-step{step}", step_ok,
                      digest=common.digest(got.astype(np.float32)), w_ok=bool(w_ok),
                      residual_ok=bool(e_ok), exact_ok=bool(exact_ok), count_ok=count_ok)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmups", default="0,1",
                        help="one run per value of powersgd(warmup_steps=...)")
    args = parser.parse_args()
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    ok = all([check(int(w), args.steps, rank, nproc) for w in args.warmups.split(",")])
    common.report("powersgd", ok)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
