"""Trains a Flax MLP for 20 steps with optax.chain(allreduce_gradients, adamw)
and checks the parameters against the same training with jax.lax.pmean
(gloo), on every process. Modes: Horovod style (axis_name=None, process-local
arrays) and axis_name='p' inside shard_map."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

STEPS = 20
BATCH = 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (64, 48):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


def loss_fn(params, batch):
    x, y = batch
    logits = MLP().apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(seed: int):
    rng = np.random.default_rng(seed)
    w = np.random.default_rng(0).normal(size=(20, 10))
    for _ in range(STEPS):
        x = rng.normal(size=(BATCH, 20)).astype(np.float32)
        yield x, np.argmax(x @ w, axis=1).astype(np.int32)


def init_params():
    return MLP().init(jax.random.key(42), jnp.zeros((1, 20)))


def max_rel_diff(a, b) -> float:
    diffs = jax.tree_util.tree_map(
        lambda u, v: float(np.max(np.abs(np.asarray(u) - np.asarray(v)) /
                                  (np.abs(np.asarray(v)) + 1e-3))), a, b)
    return max(jax.tree_util.tree_leaves(diffs))


def main() -> int:
    herring_jax.initialize()
    rank = herring_jax.process_index()
    mesh = jax.sharding.Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index)),
                             ("p",))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("p"))
    adamw = optax.adamw(1e-2)

    def global_batch(b):
        return tuple(jax.make_array_from_process_local_data(split, v) for v in b)

    def shard_map_training(grad_tx):
        """Params replicated over 'p', batch split over 'p'."""
        tx = optax.chain(grad_tx, adamw)

        def step(params, opt_state, batch):
            grads = jax.grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        # check_vma=False: gradients of the replicated parameters stay
        # per-device (as under pmap) and the transformation averages them.
        # With varying-axis checks jax would already sum them in the
        # backward pass, before any optax transformation runs.
        step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("p")),
                                     out_specs=(P(), P()), check_vma=False))
        params = jax.jit(init_params, out_shardings=rep)()
        opt_state = jax.jit(tx.init, out_shardings=rep)(params)
        for b in batches(rank):
            params, opt_state = step(params, opt_state, global_batch(b))
        return jax.tree_util.tree_map(lambda a: np.asarray(a.addressable_shards[0].data), params)

    def lax_pmean():
        return optax.GradientTransformation(
            lambda p: optax.EmptyState(),
            lambda g, s, p=None: (jax.lax.pmean(g, "p"), s))

    reference = shard_map_training(lax_pmean())

    # Horovod style: process-local arrays, reduced across processes.
    tx = optax.chain(herring_jax.allreduce_gradients(fusion_bytes=8 * 1024), adamw)
    params = jax.jit(init_params)()
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    first_loss = float(loss_fn(params, next(batches(rank))))
    for b in batches(rank):
        params, opt_state = step(params, opt_state, b)
    diff = max_rel_diff(params, reference)
    common.report("horovod-style", diff < 1e-4, max_rel_diff=diff, first_loss=first_loss,
                  final_loss=float(loss_fn(params, next(batches(rank)))),
                  digest=common.digest(np.concatenate(
                      [np.ravel(x) for x in jax.tree_util.tree_leaves(params)])))

    # Inside shard_map, reducing over the mesh axis.
    ours = shard_map_training(herring_jax.allreduce_gradients("p", fusion_bytes=8 * 1024))
    diff = max_rel_diff(ours, reference)
    common.report("axis-name", diff < 1e-4, max_rel_diff=diff)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
