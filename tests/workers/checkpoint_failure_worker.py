"""A save_sharded that fails on one process: every process must raise the
same error at once (not wait at a barrier for HERRING_TIMEOUT_S), and the
job must save and restore afterwards.

Cases, in one job of 2 processes, under --dir:
  exists  the checkpoint directory exists (rank 0 finds it);
  full    rank 1 cannot write its file (its open for writing fails as on a
          full disk), rank 0 writes its own;
  after   a save that succeeds, restored bitwise (the residual too); only
          its keys are left in jax.distributed's key-value store (those of
          the failed saves deleted); no `<name>.partial-<gen>` directory is
          left beside it (the failed save's, and one that a save killed
          midway left, are removed by this save);
  dtype   restoring it with bfloat16 parameters is refused, naming the leaf
          and both dtypes; with cast=True it gives the saved values in
          bfloat16 (dtype-cast);
then restores that must fail, with the error each gives: with the parameters
of another model, one leaf of another shape (other-model), from a directory
without a manifest (missing), from one whose shard file of process 1 lost a
byte (truncated), and from one of an unknown format (format).
Each failing case reports the exception's type and text and the seconds
until it came."""

from __future__ import annotations

import argparse
import builtins
import contextlib
import errno
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
from herring_jax._src.process import jax_compat  # noqa: E402
from sharded_worker import make_params  # noqa: E402


@contextlib.contextmanager
def full_disk_under(directory: str):
    """Opening any file under `directory` for writing fails with ENOSPC."""
    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        if (isinstance(file, str) and os.path.abspath(file).startswith(directory)
                and any(c in mode for c in "wax+")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file)
        return real_open(file, mode, *args, **kwargs)

    builtins.open = open_
    try:
        yield
    finally:
        builtins.open = real_open


def failing_save(case: str, directory: str, tx, state, params, hook) -> None:
    start = time.monotonic()
    try:
        with hook:
            herring_jax.save_sharded(directory, tx, state, params)
    except Exception as e:  # noqa: BLE001 - the case reports what it was
        common.report(case, True, type=type(e).__name__, text=str(e),
                      seconds=time.monotonic() - start,
                      manifest=os.path.exists(os.path.join(directory, "manifest.json")))
        return
    common.report(case, False, text="save_sharded did not raise")


def failing_restore(case: str, directory: str, tx, params) -> None:
    try:
        herring_jax.restore_sharded(directory, tx, params)
    except Exception as e:  # noqa: BLE001 - the case reports what it was
        common.report(case, True, type=type(e).__name__, text=str(e))
        return
    common.report(case, False, text="restore_sharded did not raise")


def everyone_here() -> None:
    jax.block_until_ready(herring_jax.allreduce(jnp.ones(1)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    herring_jax.initialize()
    rank = herring_jax.process_index()
    params = make_params("float32")
    # A lossy codec: the state holds each process's error-feedback residual.
    tx = herring_jax.sharded_optimizer(optax.adam(1e-2), compression="bf16")
    state = tx.init(params)
    grads = jax.tree_util.tree_map(lambda p: p * 0.5, params)
    _, state = jax.jit(tx.update)(grads, state, params)

    taken = os.path.join(args.dir, "exists")
    failing_save("exists", taken, tx, state, params, contextlib.nullcontext())
    full = os.path.abspath(os.path.join(args.dir, "full"))
    failing_save("full", full, tx, state, params,
                 full_disk_under(full) if rank == 1 else contextlib.nullcontext())

    if rank == 0:
        # What a save killed after its "prepare" step leaves.
        os.makedirs(os.path.join(args.dir, "killed.partial-7", "shards"))
    everyone_here()
    ok = os.path.join(args.dir, "ok")
    herring_jax.save_sharded(ok, tx, state, params)
    partials = sorted(n for n in os.listdir(args.dir) if ".partial-" in n)
    got_state, got_params = herring_jax.restore_sharded(ok, tx, params)
    same = all(common.bitwise_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree_util.tree_leaves((state, params)),
        jax.tree_util.tree_leaves((got_state, got_params))))
    # The residual is not all zeros, so that restoring zeros would show.
    same &= any(np.any(np.asarray(r) != 0) for r in jax.tree_util.tree_leaves(state.residual))
    # Read while no process can have begun the next save.
    everyone_here()
    client = jax_compat.distributed_client()
    keys = client.key_value_dir_get_bytes("herring_jax/") if rank == 0 else []
    everyone_here()
    common.report("after", same and not partials, partials=partials,
                  checkpoint_keys=[k for k, _ in keys if "/checkpoint/" in k])

    half = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)
    failing_restore("dtype", ok, tx, half)
    got_state, got_params = herring_jax.restore_sharded(ok, tx, half, cast=True)
    common.report("dtype-cast", all(
        a.dtype == jnp.bfloat16 and common.bitwise_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree_util.tree_leaves(got_params),
                        jax.tree_util.tree_leaves(half))))

    # Another model: one leaf of another shape, named with both shapes.
    other = dict(params, dense=dict(params["dense"], kernel=jnp.zeros((40, 23))))
    failing_restore("other-model", ok, tx, other)

    failing_restore("missing", full, tx, params)
    damaged = os.path.join(args.dir, "damaged")
    herring_jax.save_sharded(damaged, tx, state, params)
    if rank == 0:
        shard = os.path.join(damaged, "shards", "1.npz")
        os.truncate(shard, os.path.getsize(shard) - 1)
    everyone_here()
    failing_restore("truncated", damaged, tx, params)
    everyone_here()
    if rank == 0:
        path = os.path.join(ok, "manifest.json")
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text.replace("version 2", "version 9"))
    everyone_here()
    failing_restore("format", ok, tx, params)
    herring_jax.shutdown()


if __name__ == "__main__":
    main()
