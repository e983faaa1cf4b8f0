"""herring_jax.topk on several workers, step by step and bitwise against its
numpy model (herring_jax._src.transforms.topk.model_np): the update is the same on
every worker, each sparsified leaf is the mean of every worker's top-k of
gradient + residual, the residual is what this worker did not send, and
small leaves are averaged exactly.

Usage (under the launcher):
  python tests/workers/topk_worker.py [--steps 3]        one worker per process
  python tests/workers/topk_worker.py --axis [--steps 3]  every device a worker,
      reduced over a mesh axis inside shard_map
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.transforms import topk as topk_lib  # noqa: E402

SHAPES = {"b": (48,), "tiny": (2, 2), "w": (64, 48)}
FRACTION = 0.05


def grads(worker: int, step: int) -> dict:
    return common.make_tree(SHAPES, worker, step)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--axis", action="store_true",
                        help="every local device is a worker (shard_map over a mesh axis)")
    args = parser.parse_args()
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    ndev = jax.local_device_count() if args.axis else 1
    n = nproc * ndev
    mine = [rank * ndev + d for d in range(ndev)]  # the workers of this process

    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    if not args.axis:
        tx = herring_jax.topk(FRACTION)
        state = tx.init(params)
        update = jax.jit(tx.update)
    else:
        tx = herring_jax.topk(FRACTION, "d")
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = jax.sharding.Mesh(np.array(devices), ("d",))
        sharding = NamedSharding(mesh, P("d"))

        def per_device(g, s):
            g, s = jax.tree_util.tree_map(lambda x: x[0], (g, s))
            out, s = tx.update(g, s)
            return jax.tree_util.tree_map(lambda x: x[None], (out, s))

        update = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                       check_vma=False))

        def stacked(per_worker):  # one tree per local device -> global arrays
            local = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *per_worker)
            return jax.tree_util.tree_map(
                lambda x: jax.make_array_from_process_local_data(sharding, x,
                                                                 (n,) + x.shape[1:]), local)

        one = tx.init(params)
        state = stacked([jax.tree_util.tree_map(np.asarray, one)] * ndev)

    def local_rows(tree, d):  # worker d of this process's view of a result
        if not args.axis:
            return jax.tree_util.tree_map(np.asarray, tree)
        return jax.tree_util.tree_map(
            lambda x: np.asarray(sorted(x.addressable_shards,
                                        key=lambda s: s.device.id)[d].data)[0], tree)

    residuals = {k: [np.zeros(s, np.float32) for _ in range(n)] for k, s in SHAPES.items()
                 if topk_lib.sparsified(int(np.prod(s)), np.float32, FRACTION, n, 2.0)}
    assert set(residuals) == {"b", "w"}, residuals  # "tiny" is averaged exactly
    ok = True
    for step in range(args.steps):
        every = [grads(w, step) for w in range(n)]
        g = every[mine[0]] if not args.axis else stacked([every[w] for w in mine])
        out, state = update(jax.tree_util.tree_map(jnp.asarray, g), state)
        want = {}
        for k in residuals:
            want[k], residuals[k] = topk_lib.model_np([e[k] for e in every], residuals[k],
                                                      FRACTION)
        want["tiny"] = common.reference(  # devices of a process, then processes
            "float32", "mean", [[every[p * ndev + d]["tiny"] for d in range(ndev)]
                                for p in range(nproc)])
        checks = {}
        for d, w in enumerate(mine):
            got = local_rows(out, d)
            res = local_rows(state.residual, d)
            checks[f"update{d}"] = all(common.bitwise_equal(got[k], want[k]) for k in SHAPES)
            checks[f"residual{d}"] = all(common.bitwise_equal(res[k], residuals[k][w])
                                         for k in residuals)
            # Sparse, not a disguised exact mean: most of w's entries are zero.
            checks[f"sparse{d}"] = 0 < np.count_nonzero(got["w"]) <= n * np.ceil(
                FRACTION * got["w"].size)
        step_ok = all(checks.values())
        ok = ok and step_ok
        common.report(f"step{step}", step_ok,
                      digest=common.digest(np.concatenate([local_rows(out, 0)[k].ravel()
                                                           for k in sorted(SHAPES)])),
                      **{k: bool(v) for k, v in checks.items()})
    common.report("topk", ok)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
