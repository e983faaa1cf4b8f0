"""sharded_optimizer against optax.chain(allreduce_gradients(), inner): the
same training steps, the parameters compared bitwise (element-wise inner
transformations) or within 1e-6 (a global-norm clip), on every process; the
inner transformations that cannot run on chunks refused at init; and the
optimizer state's bytes per process."""

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

STEPS = 4


def make_params(dtype) -> dict:
    """Leaves whose sizes do not divide by 2, 3 or 4, a scalar, a matrix."""
    rng = np.random.default_rng(7)
    shapes = {"dense": {"kernel": (37, 23), "bias": (23,)}, "out": {"kernel": (23, 5)},
              "scale": (), "emb": (101, 3)}
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.normal(size=s), dtype), shapes,
        is_leaf=lambda x: isinstance(x, tuple))


def loss_fn(params, x):
    h = jnp.tanh(x @ params["dense"]["kernel"].astype(jnp.float32)
                 + params["dense"]["bias"].astype(jnp.float32))
    out = h @ params["out"]["kernel"].astype(jnp.float32)
    reg = jnp.sum(params["emb"].astype(jnp.float32) ** 2) * 1e-3
    return jnp.mean(out ** 2) * params["scale"].astype(jnp.float32) ** 2 + reg


def batch(rank: int, step: int):
    rng = np.random.default_rng(1000 * rank + step)
    return jnp.asarray(rng.normal(size=(16, 37)), jnp.float32)


def compare(name: str, dtype: str, got, ref) -> dict:
    """Parameters trained sharded against the unsharded chain's: bitwise, but
    for the clipped inner transformations, whose global norm adds the
    workers' partial sums in another order than optax.tree.norm (float32
    parameters within 1e-6, bfloat16 ones within one of their rounding
    steps). The fields of a report."""
    a, b = flat(got), flat(ref)
    if name in CLIPPED:
        tol = 1e-6 if dtype == "float32" else 2.0 ** -7
        ok = bool(np.all(np.abs(a - b) <= tol * np.maximum(np.abs(b), 1.0)))
    else:
        ok = a.tobytes() == b.tobytes()
    return {"ok": ok, "digest": common.digest(np.asarray(a)),
            "max_diff": float(np.max(np.abs(a - b))) if a.size else 0.0}


def train(tx, params, rank: int, remat: bool = False, loss_fn=loss_fn):
    """The unsharded chain; with `remat`, the loss under jax.checkpoint (which
    alone changes last bits of some gradients, with or without herring_jax,
    so fully_sharded's reshard_after_forward is compared with it)."""
    state = tx.init(params)
    loss = (jax.checkpoint(loss_fn, policy=jax.checkpoint_policies.everything_saveable)
            if remat else loss_fn)

    @jax.jit
    def step(params, state, x):
        grads = jax.grad(loss)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for k in range(STEPS):
        params, state = step(params, state, batch(rank, k))
    return params, state


def train_mesh(make_tx, sharded: bool, params):
    """The same inside jax.shard_map over every device of the job (axis 'd',
    check_vma=False); sharded_optimizer's state is sharded over 'd'."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    tx = herring_jax.sharded_optimizer(make_tx(), "d") if sharded else optax.chain(
        herring_jax.allreduce_gradients("d"), make_tx())
    state_spec = P("d") if sharded else P()
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=state_spec,
                                  check_vma=False))(params)

    def body(params, state, x):
        grads = jax.grad(loss_fn)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), state_spec, P("d")),
                                 out_specs=(P(), state_spec), check_vma=False))
    rank = herring_jax.process_index()
    for k in range(STEPS):
        local = np.concatenate([np.asarray(batch(rank * jax.local_device_count() + d, k))
                                for d in range(jax.local_device_count())])
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)
        params, state = step(params, state, x)
    return jax.tree_util.tree_map(lambda a: a.addressable_shards[0].data, params), state


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64))
                           for x in jax.tree_util.tree_leaves(tree)])


def state_bytes(state) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(state))


INNERS = {
    "sgd": lambda: optax.sgd(0.1),
    "nesterov": lambda: optax.sgd(0.02, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw-masked": lambda: optax.adamw(
        1e-2, weight_decay=0.1, mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)),
    "lion": lambda: optax.lion(1e-3),
    "rmsprop": lambda: optax.rmsprop(1e-2, momentum=0.5),
    "schedule": lambda: optax.adam(optax.exponential_decay(1e-2, 1, 0.5)),
    "decay-tree-mask": lambda: optax.chain(
        optax.add_decayed_weights(0.01, mask={"dense": {"kernel": True, "bias": False},
                                              "out": {"kernel": True}, "scale": False,
                                              "emb": True}),
        optax.sgd(0.1)),
}
CLIPPED = {"clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                             optax.adamw(1e-2))}
REFUSED = {"lamb": lambda: optax.lamb(1e-2),
           "adafactor": lambda: optax.adafactor(1e-2),
           "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--inners", default=",".join(INNERS) + "," + ",".join(CLIPPED))
    parser.add_argument("--refused", action="store_true")
    parser.add_argument("--mesh", action="store_true",
                        help="inside shard_map over every device (axis_name='d') instead")
    args = parser.parse_args()
    herring_jax.initialize()
    rank, n = herring_jax.process_index(), herring_jax.process_count()
    for dtype in args.dtypes.split(","):
        params = make_params(dtype)
        for name in args.inners.split(","):
            make = {**INNERS, **CLIPPED}[name]
            if args.mesh:
                ref, ref_state = train_mesh(make, False, params)
                got, got_state = train_mesh(make, True, params)
                got_state = jax.tree_util.tree_map(lambda a: a.addressable_shards[0].data,
                                                   got_state)
            else:
                ref, ref_state = train(optax.chain(herring_jax.allreduce_gradients(), make()),
                                       params, rank)
                got, got_state = train(herring_jax.sharded_optimizer(make()), params, rank)
            common.report(f"{dtype}/{name}", **compare(name, dtype, got, ref),
                          state_bytes=state_bytes(got_state.inner),
                          unsharded_state_bytes=state_bytes(ref_state))
    if args.refused:
        for name, make in REFUSED.items():
            try:
                herring_jax.sharded_optimizer(make()).init(make_params("float32"))
                common.report(f"refused/{name}", n == 1, error="no error")
            except ValueError as e:
                common.report(f"refused/{name}", "element by element" in str(e), error=str(e))
    # The inner transformation's checks: process 0 runs them, the others take
    # its verdicts (refusals included) without compiling the check.
    from herring_jax._src.transforms import verdicts
    common.report("verdicts", (verdicts.ran > 0 and verdicts.taken == 0) if rank == 0 else
                  (verdicts.ran == 0 and verdicts.taken > 0), ran=verdicts.ran,
                  taken=verdicts.taken)
    herring_jax.shutdown()


if __name__ == "__main__":
    main()
