"""herring_jax.powersgd on several processes, step by step against a numpy
model (float64; the factors' signs do not matter: the update is P^ P^T M):
the update is the same on every rank, matrices are averaged as rank-r
approximations, small leaves exactly, and the residual is what this
process's matrix missed.

With warmup_steps=W the first W updates average every leaf exactly. With
power_iterations=K the model reduces P and Q K times per step. With a factor
codec (run it with HERRING_HOST_STAGE=0, so that the factors cross the
transport) the model rounds each contribution and result as the engine does
(codecs.reduce_np) and compares with a tolerance of the codec's precision,
since the model's float64 products round to other codec values here and
there; bitwise, the warm-start Q is a value of the codec and the residual is
this process's matrix minus the update, both in float32.

Each step's model starts from the implementation's own state (every rank's
float32 residual, followed bitwise, and the warm-start Q), so a step is
compared with float64 from the same inputs: a model left to run on its own
drifts from float32 step after step by an amount that depends on the CPU's
kernels (2e-4 of the largest element by the third step on one CPU, 5e-6 on
another). That the implementation is itself stable is checked apart: its
P^ stays orthonormal (update^T update = Q Q^T).

Usage (under the launcher): python tests/workers/powersgd_worker.py [--steps 3]
    [--configs warmup0,warmup1,iterations2,bf16]
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

SHAPES = {"w": (64, 6, 8), "b": (48,), "tiny": (2, 2)}
RANK = 2


def grads(rank: int, step: int) -> dict:
    return common.make_tree(SHAPES, rank, step)


CONFIGS = {  # name: (warmup_steps, power_iterations, codec)
    "warmup0": (0, 1, "none"),
    "warmup1": (1, 1, "none"),
    "iterations2": (0, 2, "none"),
    "bf16": (0, 1, "bf16"),
    "bf16-iterations2": (1, 2, "bf16"),
}


def model_mean(codec: str, parts: list[np.ndarray]) -> np.ndarray:
    """The mean of float64 `parts` as the factors' reduction takes it."""
    if codec == "none":
        return np.mean(parts, axis=0)
    return codecs.reduce_np(codec, "mean", [x.astype(np.float32) for x in parts],
                            len(parts)).astype(np.float64)


def reduction_codecs(jaxpr) -> list[str]:
    """The codec of every herring_jax reduction in `jaxpr`, nested ones too."""
    found = []
    for eqn in jaxpr.eqns:
        if "codec" in eqn.params:
            found.append(eqn.params["codec"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += reduction_codecs(inner)
    return found


def check(name: str, steps: int, rank: int, nproc: int) -> bool:
    """Runs `steps` updates of powersgd in configuration `name`; reports
    each step against the model."""
    tx_warmup, iterations, codec = CONFIGS[name]
    tx = herring_jax.powersgd(rank=RANK, warmup_steps=tx_warmup, power_iterations=iterations,
                              codec=codec)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    state = tx.init(params)
    assert state.q["w"].shape == (48, RANK) and state.q["b"].shape == ()
    # What the update reduces: P and Q once per power iteration in the factor
    # codec, the exact leaves in float32 (and, with a warm-up, every leaf in
    # float32 in the warm-up's branch).
    found = sorted(reduction_codecs(jax.make_jaxpr(tx.update)(params, state).jaxpr))
    want = sorted([codec] * 2 * iterations + ["none"] * (2 if tx_warmup else 1))
    common.report(f"{name}-reductions", found == want, found=found, want=want)
    ok = found == want
    update = jax.jit(tx.update)
    # Every rank's float32 residual, which the implementation keeps as
    # (gradient + residual) - update elementwise in float32, so that this
    # process can follow it bitwise for its peers too (the update is the same
    # everywhere). Each step's model then starts from exactly the
    # implementation's inputs (its residuals and its warm-start Q) and the
    # comparison measures one step's rounding, not float32 drifting from
    # float64 over steps, which depends on the CPU's kernels.
    residuals = [np.zeros((64, 48), np.float32) for _ in range(nproc)]
    q = np.asarray(state.q["w"], np.float64)
    q0 = np.asarray(state.q["w"])
    for step in range(steps):
        before = np.asarray(state.residual["w"]).reshape(64, 48) if step >= tx_warmup else None
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
            ms32 = [e["w"].reshape(64, 48).astype(np.float32) + residuals[r]
                    for r, e in enumerate(every)]
            ms = [m.astype(np.float64) for m in ms32]
            for _ in range(iterations):
                p = model_mean(codec, [m @ q for m in ms])
                p_hat = np.linalg.qr(p)[0]
                q = model_mean(codec, [m.T @ p_hat for m in ms])
            want = p_hat @ q.T
            got = np.asarray(out["w"]).reshape(64, 48)
            model_residual = ms[rank] - want
            residuals = [m - got for m in ms32]
            scale = np.abs(want).max()
            # float32's rounding moves the rank-r subspace by up to its size over
            # the gap below it (Davis-Kahan): where the mean matrix's r-th and
            # (r+1)-th singular values nearly tie (step 2 here: 13.09 against
            # 12.31, the residual's direction against the gradient's), the
            # subspace itself is ill-determined and the tolerance widens by
            # sigma_r / (sigma_r - sigma_r+1).
            sigma = np.linalg.svd(np.mean(ms, axis=0), compute_uv=False)
            conditioning = max(1.0, sigma[RANK - 1] / max(sigma[RANK - 1] - sigma[RANK], 1e-30))
            # (A codec's tolerance, its precision, is wide enough as it is.)
            tol = 1e-4 * conditioning if codec == "none" else 2e-2
            w_ok = np.allclose(got, want, rtol=0, atol=tol * scale)
            residual = np.asarray(state.residual["w"]).reshape(64, 48)
            e_ok = np.allclose(residual, model_residual, rtol=0, atol=tol * scale)
            # Bitwise: the residual is this process's float32 matrix minus the
            # update, so it carries the factors' rounding too.
            mine = grads(rank, step)["w"].reshape(64, 48) + before
            e_ok = e_ok and np.array_equal(residual, mine - got)
            e_ok = e_ok and np.array_equal(residual, residuals[rank])
            # The warm-start Q is the decoded result of the last reduction.
            q_now = np.asarray(state.q["w"])
            e_ok = e_ok and np.array_equal(q_now, codecs.roundtrip_np(codec, q_now))
            # The implementation's P^ is orthonormal: update^T update = Q Q^T
            # (a QR that lost orthogonality would show here, whatever the model).
            q32 = q_now.astype(np.float64)
            gram = got.astype(np.float64).T @ got.astype(np.float64)
            e_ok = e_ok and np.allclose(gram, q32 @ q32.T, rtol=0,
                                        atol=1e-5 * np.abs(q32 @ q32.T).max())
            # The warm start carries over: keep the model's Q in the sign basis jax chose.
            q = np.asarray(state.q["w"], np.float64)
        count_ok = int(state.count) == min(step + 1, tx_warmup)
        step_ok = bool(w_ok and e_ok and exact_ok and count_ok)
        ok = ok and step_ok
        common.report(f"{name}-step{step}", step_ok,
                      digest=common.digest(got.astype(np.float32)), w_ok=bool(w_ok),
                      residual_ok=bool(e_ok), exact_ok=bool(exact_ok), count_ok=count_ok,
                      error=float(np.abs(got - want).max() / max(scale, 1e-30))
                      if step >= tx_warmup else 0.0,
                      tolerance=float(tol) if step >= tx_warmup else 0.0)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", default="warmup0,warmup1",
                        help=f"one run per configuration, of {', '.join(CONFIGS)}")
    args = parser.parse_args()
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    ok = all([check(c, args.steps, rank, nproc) for c in args.configs.split(",")])
    common.report("powersgd", ok)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
