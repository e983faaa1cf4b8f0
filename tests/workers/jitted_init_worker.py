"""Optimizer states made inside jax.jit together with herring reductions: every
process must compile the same program (a rank traced in as a constant makes
each process's program, and so its run id, differ, and no reduction in it
ever pairs). Each case's jitted state must equal the eager one bitwise.

Cases:
- sharded: ``sharded_optimizer(adam)``'s init after a user's allreduce.
- sharded-norm: ``sharded_optimizer`` of a transformation whose init takes
  ``optax.tree.norm`` of the parameters (a herring reduction inside init),
  with no reduction of the user's.
- topk: ``topk``'s init after a user's allreduce.

Usage (under the launcher): python tests/workers/jitted_init_worker.py
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

SHAPES = {"w": (5, 7), "b": (3,)}


class NormState(NamedTuple):
    norm: jax.Array


def norm_at_init() -> optax.GradientTransformation:
    """Identity updates; its init keeps the parameters' global norm (which
    inside sharded_optimizer is a reduction across the workers)."""
    def init(params):
        return NormState(optax.tree.norm(params))

    def update(updates, state, params=None):
        del params
        return updates, state
    return optax.GradientTransformation(init, update)


def same(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        common.bitwise_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def main() -> int:
    herring_jax.initialize()
    rank = herring_jax.process_index()
    params = {k: jnp.asarray(v) for k, v in common.make_tree(SHAPES, rank, 0).items()}
    cases = {
        "sharded": (herring_jax.sharded_optimizer(optax.adam(1e-3)), True),
        "sharded-norm": (herring_jax.sharded_optimizer(norm_at_init()), False),
        "topk": (herring_jax.topk(0.5), True),
    }
    ok = True
    for name, (tx, user_reduction) in cases.items():
        def init(p, tx=tx, user_reduction=user_reduction):
            if user_reduction:
                p = herring_jax.allreduce(p, op="mean")
            return tx.init(p)

        jitted = jax.jit(init)(params)
        eager = init(params)
        shard = jitted.shard if name != "topk" else jitted.process
        case_ok = same(jitted, eager) and int(shard) == rank
        ok = ok and case_ok
        common.report(name, case_ok, shard=int(shard))
    herring_jax.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
