"""fully_sharded(compression=..., error_feedback=...): what the residual does.

Cases (under the launcher):
  --case codecs: a small tanh model trained with each codec, error feedback
    on and off, against the exact (uncompressed) run; with the host stage off
    each process's gradients cross the wire encoded, and error feedback must
    change the parameters and bring them nearer the exact run.
  --case model: a linear loss (its gradient is the batch, whatever the
    parameters) with several microbatches per step through
    value_and_grad(..., accumulate=); every step's gradient chunks and
    residual against the numpy model of what each process encoded.
  --case one-host: with the host stage on, one host encodes nothing: error
    feedback keeps no residual and the run is bitwise the exact one.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.collectives import codecs  # noqa: E402


def tanh_params() -> dict:
    rng = np.random.default_rng(3)
    return {"w1": jnp.asarray(rng.normal(size=(64, 32)) / 8, jnp.float32),
            "b1": jnp.zeros(32, jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(32, 8)) / 6, jnp.float32)}


def tanh_loss(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    y = jnp.sin(x[:, :8])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def tanh_batch(rank: int, step: int):
    rng = np.random.default_rng(100 * rank + step)
    return jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)


def train(fs, steps: int, rank: int):
    state = fs.init(tanh_params())

    @jax.jit
    def step(state, x):
        _, grads = fs.value_and_grad(tanh_loss)(state, x)
        return fs.apply_gradients(state, grads)

    for k in range(steps):
        state = step(state, tanh_batch(rank, k))
    return common_flat(jax.jit(fs.gather)(state)), state


def common_flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float32))
                           for x in jax.tree_util.tree_leaves(tree)])


def codecs_case(names: list[str], steps: int, rank: int) -> None:
    exact, _ = train(herring_jax.fully_sharded(optax.sgd(0.5)), steps, rank)
    scale = float(np.max(np.abs(exact)))
    for codec in names:
        on, state = train(herring_jax.fully_sharded(optax.sgd(0.5), compression=codec),
                          steps, rank)
        off, _ = train(herring_jax.fully_sharded(optax.sgd(0.5), compression=codec,
                                                 error_feedback=False), steps, rank)
        err_on = float(np.max(np.abs(on - exact))) / scale
        err_off = float(np.max(np.abs(off - exact))) / scale
        residual = common_flat(state.residual)
        common.report(f"codecs/{codec}", err_on < err_off and on.tobytes() != off.tobytes(),
                      digest=common.digest(on), err_on=err_on, err_off=err_off,
                      residual_max=float(np.max(np.abs(residual))))


MODEL_SIZE = 1024  # one leaf: N = 2 chunks of 512, each whole codec blocks
MICRO = 3


def micro_batch(rank: int, step: int, k: int) -> np.ndarray:
    return common.make_input("float32", MODEL_SIZE, rank, 10 * step + k)


def model_case(codec: str, steps: int, rank: int, nproc: int, reshard: bool = False) -> None:
    """Every step: MICRO microbatches accumulated through value_and_grad's
    `accumulate`, against the numpy model: each reduction's contribution is
    the microbatch's gradient plus the residual the previous reduction left
    (the state's for the first), the residual becomes what encoding that
    lost, and each process's chunk is its part of the engine's compressed
    mean, the MICRO means summed in order. `reshard`: the same with
    reshard_after_forward (the backward pass under jax.checkpoint)."""
    fs = herring_jax.fully_sharded(optax.sgd(0.1), compression=codec,
                                   reshard_after_forward=reshard)
    state = fs.init({"w": jnp.zeros(MODEL_SIZE, jnp.float32)})

    def loss(params, c):
        return jnp.sum(params["w"] * c)  # its gradient is c, whatever the parameters

    @jax.jit
    def step(state, cs):  # the guide's recipe (fully_sharded.md)
        def one(grads, c):
            value, grads = fs.value_and_grad(loss)(state, c, accumulate=grads)
            return grads, value
        grads, _ = jax.lax.scan(one, fs.zero_gradients(state), cs)
        return fs.apply_gradients(state, grads), grads

    residuals = [np.zeros(MODEL_SIZE, np.float32) for _ in range(nproc)]
    part = MODEL_SIZE // nproc
    ok = True
    for t in range(steps):
        cs = jnp.asarray(np.stack([micro_batch(rank, t, k) for k in range(MICRO)]))
        state, grads = step(state, cs)
        want = np.zeros(part, np.float32)
        for k in range(MICRO):
            sent = [micro_batch(r, t, k) + residuals[r] for r in range(nproc)]
            mean = codecs.reduce_np(codec, "mean", sent, nproc)
            residuals = [s - codecs.roundtrip_np(codec, s) for s in sent]
            want = want + mean[rank * part:(rank + 1) * part]
        got = np.asarray(grads.chunks["w"])
        got_e = np.asarray(state.residual["w"])
        step_ok = (common.bitwise_equal(got, want)
                   and common.bitwise_equal(got_e, residuals[rank]) and bool(np.any(got_e != 0)))
        ok = ok and step_ok
        name = f"model/{codec}{'/reshard' if reshard else ''}/step{t}"
        common.report(name, step_ok, digest=common.digest(got),
                      chunk_diff=float(np.max(np.abs(got - want))),
                      residual_diff=float(np.max(np.abs(got_e - residuals[rank]))))


def one_host_case(codec: str, steps: int, rank: int) -> None:
    exact, _ = train(herring_jax.fully_sharded(optax.sgd(0.5)), steps, rank)
    on, state = train(herring_jax.fully_sharded(optax.sgd(0.5), compression=codec), steps, rank)
    residual = common_flat(state.residual)
    common.report(f"one-host/{codec}", on.tobytes() == exact.tobytes() and
                  not np.any(residual), digest=common.digest(on),
                  max_diff=float(np.max(np.abs(on - exact))),
                  residual_max=float(np.max(np.abs(residual))))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="codecs")
    parser.add_argument("--codecs", default="bf16,fp16,int8")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    herring_jax.initialize()
    rank = herring_jax.process_index()
    names = args.codecs.split(",")
    if args.case == "codecs":
        codecs_case(names, args.steps, rank)
    elif args.case == "model":
        for codec in names:
            model_case(codec, args.steps, rank, herring_jax.process_count())
        model_case(names[-1], args.steps, rank, herring_jax.process_count(), reshard=True)
    elif args.case == "one-host":
        for codec in names:
            one_host_case(codec, args.steps, rank)
    else:
        raise SystemExit(f"unknown --case {args.case!r}")
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
