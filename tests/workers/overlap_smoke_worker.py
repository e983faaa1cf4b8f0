"""The standard training step (value_and_grad + allreduce_gradients + sgd in
one jit) overlaps its reductions with the backward pass: in every step the
first gradient bucket's reduction was taken up by herring before the last
gradient (the first layer's) was computed. An ordering of events from the
engine's timeline and a callback in the backward pass, never a duration. Also:
every step's reduced gradients are bitwise those of its local gradients
reduced outside the step."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.process import runtime  # noqa: E402

LAYERS, WIDTH, BATCH, STEPS = 6, 512, 512, 4
last_gradient_ns: list[int] = []


@jax.custom_vjp
def marked(w):
    return w


def _fwd(w):
    return w, None


def _bwd(_, ct):
    # Runs when the first layer's weight gradient exists: the last gradient.
    jax.debug.callback(lambda s: last_gradient_ns.append(time.monotonic_ns()), ct.sum())
    return (ct,)


marked.defvjp(_fwd, _bwd)


def loss_fn(params, x, y):
    h = x
    for i, layer in enumerate(params):
        w = marked(layer["w"]) if i == 0 else layer["w"]
        h = jnp.tanh(h @ w + layer["b"])
    return jnp.mean((h - y) ** 2)


def main() -> int:
    herring_jax.initialize()
    me = herring_jax.process_index()
    key = jax.random.key(0)
    params = []
    for _ in range(LAYERS):
        key, k = jax.random.split(key)
        params.append({"w": jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH ** 0.5,
                       "b": jnp.zeros(WIDTH)})
    rng = np.random.default_rng(me)
    x = jnp.asarray(rng.normal(size=(BATCH, WIDTH)).astype(np.float32))
    y = jnp.asarray(rng.normal(size=(BATCH, WIDTH)).astype(np.float32))
    # 1 MiB buffers: one per layer (6 MiB of gradients in all).
    reducer = herring_jax.allreduce_gradients()
    sgd = optax.sgd(1e-2)
    tx = optax.chain(reducer, sgd)  # the state step() threads (reducer's is empty)

    @jax.jit
    def step(p, s):
        _, g = jax.value_and_grad(loss_fn)(p, x, y)
        reduced, _ = reducer.update(g, reducer.init(g))
        u, s = sgd.update(reduced, s, p)
        return optax.apply_updates(p, u), s, g, reduced

    p, s = params, tx.init(params)
    jax.block_until_ready(step(p, s))  # compile
    checks = []
    runtime.take_timeline()
    last_gradient_ns.clear()
    starts = []
    for _ in range(STEPS):
        starts.append(time.monotonic_ns())
        p, s, g, reduced = jax.block_until_ready(step(p, s))
        checks.append((g, reduced))
    events = runtime.take_timeline()
    bounds = starts + [time.monotonic_ns()]
    per_step = [[e for e in events if bounds[i] <= e["issued_ns"] < bounds[i + 1]]
                for i in range(STEPS)]
    counts = [len(r) for r in per_step]
    common.report("several-buckets-per-step", min(counts) >= 3 and len(set(counts)) == 1,
                  counts=counts)
    early = []
    for i, reds in enumerate(per_step):
        last = [t for t in last_gradient_ns if bounds[i] <= t < bounds[i + 1]]
        first_begun = min(e["begun_ns"] for e in reds) if reds else None
        early.append(bool(last) and first_begun is not None and first_begun < last[0])
    common.report("first-reduction-before-last-gradient", all(early), per_step=early)

    # Every step's reduced gradients are bitwise the rank-order sums of its
    # local gradients reduced outside the step (same buffers, one call each).
    reduce_only = jax.jit(lambda g: reducer.update(g, reducer.init(g))[0])
    common.report("bitwise-equal-to-unoverlapped", all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for g, reduced in checks
        for a, b in zip(jax.tree.leaves(reduced), jax.tree.leaves(reduce_only(g)))))
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
