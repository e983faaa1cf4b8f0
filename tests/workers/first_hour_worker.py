"""A training script as a new user writes it: a Flax MLP, optax.chain(
allreduce_gradients(), adamw), a jitted step, run under `herring-jax launch`.
Each mode is one of the ways such a script went wrong in its first hour
(tests/test_first_hour.py):

  raise       rank 1 raises RuntimeError at step 10 of 60.
  shutdown    200 jitted steps, then herring_jax.shutdown() at once (the steps
              are still queued: jax dispatches asynchronously); --devices 2
              runs them under shard_map on 2 devices per process.
  check_vma   allreduce_gradients('d') inside shard_map with check_vma=True
              and False; reports the error or the parameters of each.
  mismatch    rank 1 trains on a batch of 31 instead of 32 (another program).
  broadcast   rank 1's model has another width; broadcast(params) from rank 0.
  friction    a misspelt axis, a string array, an integer mean: each error names
              what is wrong (bound axes, the leaf's path).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402


class MLP(nn.Module):
    width: int = 64

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


def loss_fn(params, x, y, model=MLP()):
    logits = model.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def data(rank: int, batch: int, step: int):
    rng = np.random.default_rng(1000 * rank + step)
    x = rng.normal(size=(batch, 20)).astype(np.float32)
    return x, (np.abs(x[:, 0]) * 3).astype(np.int32) % 10


def make_step(tx, model=MLP()):
    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y, model)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return step


def horovod_style(steps: int, batch: int, fail_at: int | None = None):
    rank = herring_jax.process_index()
    params = MLP().init(jax.random.key(0), jnp.zeros((1, 20)))
    tx = optax.chain(herring_jax.allreduce_gradients(), optax.adamw(1e-3))
    opt_state = tx.init(params)
    step = make_step(tx)
    for i in range(steps):
        if fail_at is not None and i == fail_at and rank == 1:
            # When, on the clock the test reads too (one machine).
            common.report("raised", True, at=time.time())
            raise RuntimeError(f"bad batch at step {i}")
        x, y = data(rank, batch, i)
        params, opt_state = step(params, opt_state, x, y)
    return params


def sharded_steps(steps: int, check_vma: bool, sgd: bool = False):
    """allreduce_gradients('d') inside shard_map over every device of the job."""
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    params = MLP().init(jax.random.key(0), jnp.zeros((1, 20)))
    inner = optax.sgd(0.1) if sgd else optax.adamw(1e-3)
    tx = optax.chain(herring_jax.allreduce_gradients("d"), inner)
    opt_state = tx.init(params)

    def body(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")),
                                 out_specs=(P(), P()), check_vma=check_vma))
    replicated = NamedSharding(mesh, P())
    params, opt_state = jax.device_put((params, opt_state), replicated)
    n_local = jax.local_device_count()
    rank = herring_jax.process_index()
    for i in range(steps):
        x, y = data(rank, 8 * n_local, i)
        xs = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), x)
        ys = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), y)
        params, opt_state = step(params, opt_state, xs, ys)
    return params


def friction() -> None:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    f = jax.jit(jax.shard_map(lambda x: herring_jax.psum(x, "dta"), mesh=mesh,
                              in_specs=P("data"), out_specs=P()))
    x = jax.device_put(jnp.ones(jax.device_count()), NamedSharding(mesh, P("data")))
    try:
        f(x)
        common.report("misspelt axis", False, error="no error")
    except NameError as e:
        common.report("misspelt axis", "'dta'" in str(e) and "['data']" in str(e), error=str(e))
    for tree, name in (({"params": {"w": np.array(["a", "b"])}}, "['params']['w']"),
                       (np.array(["a"]), "the array")):
        try:
            herring_jax.allreduce(tree)
            common.report(f"string array {name}", False, error="no error")
        except TypeError as e:
            common.report(f"string array {name}", name in str(e) and "dtype str" in str(e)
                          and "Cast it first" in str(e), error=str(e))
    try:
        herring_jax.allreduce({"step": jnp.ones(3, jnp.int32)}, op="mean")
        common.report("integer mean", False, error="no error")
    except TypeError as e:
        common.report("integer mean", "['step']" in str(e), error=str(e))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["raise", "shutdown", "check_vma", "mismatch",
                                         "broadcast", "friction"])
    args = parser.parse_args()
    t0 = time.monotonic()
    herring_jax.initialize()
    rank = herring_jax.process_index()
    if args.mode == "raise":
        params = horovod_style(60, 32, fail_at=10)  # noqa: F841 - alive until shutdown()
    elif args.mode == "shutdown":
        # The parameters stay alive until shutdown(), as in any script that
        # goes on to save or evaluate them.
        if jax.local_device_count() > 1:
            params = sharded_steps(200, check_vma=False)
        else:
            params = horovod_style(200, 32)
        herring_jax.shutdown()
        del params
        print(f"rank {rank} done after {time.monotonic() - t0:.1f} s", flush=True)
        common.report("shutdown", True)
        return
    elif args.mode == "check_vma":
        for check_vma in (False, True):
            try:
                params = sharded_steps(1, check_vma, sgd=True)
                digest = common.digest(np.concatenate(
                    [np.ravel(np.asarray(v)) for v in jax.tree_util.tree_leaves(params)]))
                common.report(f"check_vma={check_vma}", True, digest=digest)
            except ValueError as e:
                common.report(f"check_vma={check_vma}", True, error=str(e))
    elif args.mode == "mismatch":
        params = horovod_style(5, 31 if rank == 1 else 32)  # noqa: F841 - until shutdown()
    elif args.mode == "friction":
        friction()
    elif args.mode == "broadcast":
        model = MLP(width=72 if rank == 1 else 64)
        params = model.init(jax.random.key(rank), jnp.zeros((1, 20)))
        herring_jax.broadcast(params, root=0)
    common.report(args.mode, True)
    herring_jax.shutdown()


if __name__ == "__main__":
    main()
