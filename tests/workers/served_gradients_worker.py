"""allreduce_gradients with its default buffers in a job with server-only
processes (herring-jax launch --servers K): the gradients (5 float32 leaves
of 2 MiB) are fused into buffers large enough for the servers to take, so
that the servers carry them without the user raising fusion_bytes. The mean
is checked bitwise against numpy's rank-order sum over the workers, divided
by their count (common.reference), and the worker reports how many buffers
of one update went through the servers; and that with a wire codec the
default buffers stay those of a job without servers.

Usage (under the launcher): python tests/workers/served_gradients_worker.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

LEAVES = 5
ELEMENTS = 2**19  # 2 MiB of float32 each


def counted(before: dict) -> tuple[int, int]:
    """(buffers through the servers, buffers reduced) since `before`."""
    now = herring_jax.stats()
    return (now["served_jobs"] - before["served_jobs"],
            now["reductions"] - before["reductions"])


def main() -> int:
    herring_jax.initialize()
    me, nproc = jax.process_index(), jax.process_count()
    hosts = common.hosts_from_env(nproc)
    everyone = [{f"w{i}": common.make_input("float32", ELEMENTS, r, i) for i in range(LEAVES)}
                for r in range(nproc)]
    tx = herring_jax.allreduce_gradients()
    update = jax.jit(lambda g: tx.update(g, tx.init(g))[0])
    grads = jax.tree.map(jnp.asarray, everyone[me])
    before = herring_jax.stats()
    got = jax.tree.map(np.asarray, update(grads))
    served, buffers = counted(before)
    ok = True
    for name in sorted(got):
        want = common.reference("float32", "mean", [[g[name]] for g in everyone], hosts)
        ok = ok and common.bitwise_equal(got[name], want)
    common.report("allreduce_gradients/default-buffers", ok, served=served, buffers=buffers,
                  digest=common.digest(np.concatenate([got[k] for k in sorted(got)])))
    # With a codec the default stays a sixteenth (the buffers would change
    # the encoded bits): 2 MiB buffers, below the servers' smallest.
    tx = herring_jax.allreduce_gradients(compression="int8", error_feedback=False)
    update = jax.jit(lambda g: tx.update(g, tx.init(g))[0])
    before = herring_jax.stats()
    got = jax.tree.map(np.asarray, update(grads))
    served, buffers = counted(before)
    common.report("allreduce_gradients/int8/default-buffers",
                  all(np.isfinite(v).all() and v.shape == (ELEMENTS,) for v in got.values()),
                  served=served, buffers=buffers)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
