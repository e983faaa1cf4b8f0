"""herring_jax.broadcast and the averaging of non-gradient state, as a
Horovod/SMDDP user does it: parameters initialised differently on every rank
are broadcast from one rank; a Flax model with BatchNorm trains with
allreduce_gradients, and its running statistics are averaged with
allreduce(op="mean") (the recipe of docs/guides/broadcast_state.md). Checked against each rank's own
recomputation of every other rank's values."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402


def tree_for(rank: int) -> dict:
    """A tree any rank can rebuild for any rank: odd bits on purpose."""
    f = common.make_input("float32", 64, rank, 1)
    f[:3] = [-0.0, np.nan, np.float32(1e-42)]  # sign of zero, NaN, subnormal
    nan_payload = np.array([0x7FC01234], np.uint32).view(np.float32)
    return {
        "f32": f,
        "nan": np.concatenate([nan_payload, f[:3]]),
        "bf16": common.make_input("bfloat16", 33, rank, 2),
        "i32": common.make_input("int32", 17, rank, 3),
        "bool": common.make_input("int32", 9, rank, 4) % 2 == 0,
        "c64": (common.make_input("float32", 5, rank, 5) * (1 + 2j)).astype(np.complex64),
        "empty": np.zeros((0, 3), np.float32),
        "u8": (common.make_input("int32", 7, rank, 6) % 256).astype(np.uint8),
    }


def bitwise_tree(a, b) -> bool:
    return all(common.bitwise_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(32)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(4)(nn.relu(x))


def batch_for(rank: int, step: int):
    rng = np.random.default_rng(1000 * rank + step)
    return (rng.normal(size=(16, 8)).astype(np.float32) * (1 + rank),
            rng.integers(0, 4, 16).astype(np.int32))


def main() -> int:
    herring_jax.initialize()
    me, n = herring_jax.process_index(), herring_jax.process_count()

    # -- broadcast: bitwise the root's, eager and jitted, for two roots ---------
    mine = tree_for(me)
    for root in (0, n - 1):
        want = tree_for(root)
        common.report(f"broadcast/eager/root={root}", bitwise_tree(
            herring_jax.broadcast(mine, root=root), want))
        common.report(f"broadcast/jit/root={root}", bitwise_tree(
            jax.jit(lambda t, root=root: herring_jax.broadcast(t, root=root))(mine), want))
    try:
        herring_jax.broadcast(mine, root=n)
        common.report("broadcast/bad-root", False, why="no error")
    except ValueError as e:
        common.report("broadcast/bad-root", "root" in str(e), why=str(e))
    local = jax.local_devices()
    if len(local) > 1:
        mesh = jax.sharding.Mesh(np.array(local), ("d",))
        x = jax.device_put(jnp.ones((len(local), 3)),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
        try:
            jax.jit(herring_jax.broadcast)(x)
            common.report("broadcast/multi-device", False, why="no error")
        except ValueError as e:
            common.report("broadcast/multi-device", "one device per process" in str(e),
                          why=str(e))
    else:
        common.report("broadcast/multi-device", True, note="one local device")

    # -- a BatchNorm model: broadcast init, grads and running stats averaged ---
    model = Net()
    x0, _ = batch_for(me, 0)
    variables = model.init(jax.random.key(me), x0, train=False)  # differs per rank
    variables = herring_jax.broadcast(variables, root=0)
    tx = optax.chain(herring_jax.allreduce_gradients(), optax.sgd(0.1))

    def local_update(params, stats, x, y):
        def loss_fn(p):
            logits, new = model.apply({"params": p, "batch_stats": stats}, x, train=True,
                                      mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new
        (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, new["batch_stats"], grads

    @jax.jit
    def step(params, stats, opt_state, x, y):
        _, local_stats, grads = local_update(params, stats, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        stats = herring_jax.allreduce(local_stats, op="mean")  # docs/guides/broadcast_state.md's recipe
        return optax.apply_updates(params, updates), stats, opt_state, local_stats

    params, stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)
    stats_ok = True
    for s in range(3):
        x, y = batch_for(me, s)
        # Every rank recomputes every rank's local statistics from the same
        # (shared) parameters: the expected mean, independently of herring.
        expected = jax.tree.map(
            lambda *v: np.mean(np.stack([np.asarray(a) for a in v]), axis=0),
            *[jax.jit(local_update)(params, stats, *batch_for(r, s))[1] for r in range(n)])
        params, stats, opt_state, _ = step(params, stats, opt_state, x, y)
        stats_ok &= all(np.allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)
                        for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(expected)))
    common.report("batchnorm/stats-are-the-mean", stats_ok)
    # Identical on every rank: published digests must agree (checked by the test).
    common.report("batchnorm/params", True,
                  digest=common.digest(np.concatenate([np.asarray(v, np.float32).ravel()
                                                       for v in jax.tree.leaves(params)])))
    common.report("batchnorm/stats", True,
                  digest=common.digest(np.concatenate([np.asarray(v, np.float32).ravel()
                                                       for v in jax.tree.leaves(stats)])))
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
