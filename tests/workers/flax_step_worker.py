"""A Flax training step with allreduce_gradients over several buckets, for
the GPU check (tests/gpu/run.sh; on CPU devices in its dry run).

  checked-step-<i>: a step that also returns the local and the reduced
    gradients: the reduced ones are bitwise the numpy rank-order mean of every
    rank's local ones, and the new parameters bitwise the numpy SGD update
    with them (the learning rate is a power of two: the product is exact, so
    a fused multiply-add gives the same bits); parameter digests equal on
    every rank (the driver compares them).
  standard-steps: the standard step (value_and_grad, optax.chain(
    allreduce_gradients(), sgd) in one jit) run --steps times: parameters
    bitwise equal on every rank; rank 0 writes the compiled step's HLO (XLA's
    schedule: where each start sits among the backward pass's kernels) to
    --hlo and the engine's timeline of these steps to --timeline.

Ranks hand each other their local gradients through files in --exchange
(the processes share one machine): XLA's own collectives would go to NCCL,
which refuses two ranks on one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.process import runtime  # noqa: E402

LR = 2.0 ** -4


class MLP(nn.Module):
    width: int
    layers: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = jnp.tanh(nn.Dense(self.width)(x))
        return nn.Dense(1)(x)


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(tree)])


def exchange(directory: str, name: str, rank: int, nproc: int, mine: np.ndarray,
             timeout_s: float = 120.0) -> list[np.ndarray]:
    """Every rank's array, in rank order (written whole, then renamed)."""
    path = os.path.join(directory, f"{name}.rank{rank}.npy")
    np.save(path + ".tmp.npy", mine)
    os.replace(path + ".tmp.npy", path)
    out = []
    deadline = time.monotonic() + timeout_s
    for r in range(nproc):
        other = os.path.join(directory, f"{name}.rank{r}.npy")
        while not os.path.exists(other):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {r} wrote no {other} in {timeout_s} s")
            time.sleep(0.02)
        out.append(np.load(other))
    return out


def _fingerprint(compiled) -> str:
    """XLA's fingerprint of a compiled function, where jax exposes it."""
    try:
        value = compiled.runtime_executable().fingerprint
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        return f"unavailable ({type(e).__name__})"
    if isinstance(value, bytes):
        return value.decode("ascii", "backslashreplace")
    return repr(value)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--exchange", required=True)
    p.add_argument("--hlo", default=None)
    p.add_argument("--timeline", default=None)
    args = p.parse_args()
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    os.makedirs(args.exchange, exist_ok=True)

    model = MLP(args.width, args.layers)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, args.width)))
    layer_bytes = (args.width * args.width + args.width) * 4
    # About one layer per bucket: several reductions per step.
    reducer = herring_jax.allreduce_gradients(fusion_bytes=layer_bytes,
                                              first_bucket_bytes=layer_bytes)
    sgd = optax.sgd(LR)
    tx = optax.chain(reducer, sgd)

    def batch(step):
        rng = np.random.default_rng(1000 * step + rank)
        x = rng.normal(size=(args.batch, args.width)).astype(np.float32)
        return x, np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)

    def loss_fn(p, x, y):
        return jnp.mean((model.apply(p, x) - y) ** 2)

    @jax.jit
    def checked_step(p, x, y):
        # One value for both uses: without the barrier XLA may compute a
        # gradient twice, in two fusions that sum the batch in another order
        # (on an H200 it did so for the last layer's scalar bias: the step
        # returned one gradient and reduced another, 6 ulp apart).
        grads = jax.lax.optimization_barrier(jax.grad(loss_fn)(p, x, y))
        reduced, _ = reducer.update(grads, reducer.init(grads))
        updates, _ = sgd.update(reduced, sgd.init(p), p)
        return optax.apply_updates(p, updates), grads, reduced

    @jax.jit
    def step(p, s, x, y):  # the standard way
        _, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    # Each rank's compiled checked_step and XLA's fingerprint of it, for
    # tests/gpu/checks.py to compare when the ranks' run ids differ (the run
    # id's base derives from that fingerprint). Traced from this one line on
    # every rank, as the calls below then reuse it.
    compiled_checked = checked_step.lower(params, *batch(0)).compile()
    if args.hlo:
        with open(f"{args.hlo}.checked.rank{rank}", "w") as f:
            f.write(f"fingerprint {_fingerprint(compiled_checked)}\n")
            f.write(compiled_checked.as_text())
    buckets = None
    for i in range(args.steps):
        new, grads, reduced = checked_step(params, *batch(i))
        local = exchange(args.exchange, f"grads{i}", rank, nproc, flat(grads))
        want = common.reference("float32", "mean", [[g] for g in local],
                                common.hosts_from_env(nproc))
        got = flat(reduced)
        want_params = flat(params) - np.float32(LR) * got
        reduced_ok = common.bitwise_equal(got, want)
        params_ok = common.bitwise_equal(flat(new), want_params.astype(np.float32))
        # Where the reduction differs from numpy's: each element's index, the
        # leaf it lies in, and the bits of every operand, to tell a rounding
        # mode (a flushed subnormal, a fused multiply-add) from a wrong sum.
        bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        offsets = np.cumsum([0] + [int(np.size(v)) for v in jax.tree_util.tree_leaves(grads)])
        paths = [jax.tree_util.keystr(k) for k, _ in
                 jax.tree_util.tree_flatten_with_path(grads)[0]]
        where = [{"index": int(j), "leaf": paths[int(np.searchsorted(offsets, j, "right")) - 1],
                  "got": float(got[j]).hex(), "want": float(want[j]).hex(),
                  "locals": [float(g[j]).hex() for g in local]} for j in bad[:4]]
        params = new
        common.report(f"checked-step-{i}", reduced_ok and params_ok,
                      digest=common.digest(flat(params)), reduced_ok=reduced_ok,
                      params_ok=params_ok, mismatched=int(bad.size), first_mismatches=where)

    s = tx.init(params)
    # Every rank traces the step here first: XLA's fingerprint, hence the run
    # id that matches reductions across processes, covers the traceback of the
    # call that first traced it.
    compiled = step.lower(params, s, *batch(100)).compile()
    if rank == 0 and args.hlo:
        with open(args.hlo, "w") as f:
            f.write(compiled.as_text())
    jax.block_until_ready(step(params, s, *batch(100)))  # warm up
    runtime.take_timeline()
    bounds = []
    for i in range(args.steps):
        bounds.append(time.monotonic_ns())
        params, s = jax.block_until_ready(step(params, s, *batch(100 + i)))
    bounds.append(time.monotonic_ns())
    events = runtime.take_timeline()
    buckets = [sum(1 for e in events if bounds[i] <= e["issued_ns"] < bounds[i + 1])
               for i in range(args.steps)]
    if rank == 0 and args.timeline:
        with open(args.timeline, "w") as f:
            json.dump({"step_bounds_ns": bounds, "events": events}, f)
    common.report("standard-steps", min(buckets) >= 3, digest=common.digest(flat(params)),
                  buckets_per_step=buckets,
                  step_ms=[round((b - a) / 1e6, 2) for a, b in zip(bounds, bounds[1:])])
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
