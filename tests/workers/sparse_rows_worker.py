"""allreduce_gradients(sparse_rows=...) on several processes, bitwise against
the dense reduction of the same gradients (allreduce_gradients without
sparse_rows) and against the numpy model of the engine's order
(herring_jax._src.transforms.sparse_rows.model_np).

Cases (each reports a digest of the result, which the test compares across
ranks):
  eager/<dtype>/<mean|sum>/<found|given>: one update outside jit; the table
      holds a row of -0.0 from one rank only, from every rank, from rank 0
      only, rows touched by one rank only and by all;
  given-equals-found: the row ids given and the rows found give one result;
  eager-fallback: rank 0 over the bound outside jit: the dense reduction;
  jit-fallback/step<t>: a jitted update whose steps alternate within and
      over the bound (one rank touches too many rows): every step is the
      dense result, and the bytes the engine reduced say which branch ran;
  flax/<found|given>: nn.Embed training steps under jit, the parameters
      bitwise those of the dense run after each step.

Usage (under the launcher): python tests/workers/sparse_rows_worker.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.transforms import sparse_rows as sparse_lib  # noqa: E402

V, D, K = 48, 6, 12
IS_EMB = lambda path, g: "emb" in jax.tree_util.keystr(path)  # noqa: E731


def touched(rank: int, n: int, step: int = 0, many: bool = False) -> list[int]:
    """The rows rank touches: some of its own, some shared, the -0.0 rows."""
    if many:
        return list(range(0, V, 2))[:K + 3]
    rows = {rank, 10 + rank + step, 20, 21, 30, 31, 32, 33}
    if rank != 1:
        rows.discard(30)  # row 30: -0.0 from rank 1 only
    if rank != 0:
        rows.discard(32)  # row 32: -0.0 from rank 0 only (dense: -0.0 + 0.0 = +0.0)
    return sorted(rows)


def table(rank: int, n: int, dtype, step: int = 0, many: bool = False) -> np.ndarray:
    rng = np.random.RandomState(1000 * step + rank)
    g = np.zeros((V, D), np.float32)
    rows = touched(rank, n, step, many)
    for row in rows:
        # Magnitudes far apart: the order of the sum shows in the bits.
        g[row] = rng.randn(D) * 10.0 ** rng.randint(-3, 8, D)
    if not many:
        for row in (30, 31, 32):
            if row in rows:
                g[row] = -0.0
        g[33, :3] = -0.0  # row 33, touched by every rank: partly -0.0
    return g.astype(dtype)


def bits_equal(a, b) -> bool:
    return common.bitwise_equal(np.asarray(a), np.asarray(b))


def grads_of(rank, n, dtype, step=0, many=False):
    return {"emb": jnp.asarray(table(rank, n, dtype, step, many)),
            "w": jnp.asarray(np.arange(5, dtype=np.float32) * (rank + 1) / 3)}


def ids_of(rank, n, step=0, many=False):
    # Duplicates and out-of-range ids, as a batch's tokens may hold; the
    # same length on every rank (one program everywhere).
    rows = touched(rank, n, step, many)
    ids = rows + rows[:3] + [V + 7, -1]
    return jnp.asarray(ids + [V] * (32 - len(ids)), jnp.int32)


def eager_cases(rank, n, order):
    found_sum = None
    for dtype in ("float32", "bfloat16"):
        np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
        for mean in (True, False):
            dense = herring_jax.allreduce_gradients(average=mean)
            sparse = herring_jax.allreduce_gradients(average=mean, sparse_rows=IS_EMB,
                                                     sparse_max_rows=K)
            g = grads_of(rank, n, np_dtype)
            want, _ = dense.update(g, dense.init(g))
            model = sparse_lib.model_np([table(r, n, np_dtype) for r in range(n)], order, mean)
            for how in ("found", "given"):
                extra = {"row_ids": ids_of(rank, n)} if how == "given" else {}
                got, _ = sparse.update(g, sparse.init(g), **extra)
                ok = (bits_equal(got["emb"], want["emb"]) and bits_equal(got["w"], want["w"])
                      and bits_equal(got["emb"], model))
                emb = np.asarray(got["emb"]).astype(np.float32)
                common.report(f"eager/{dtype}/{'mean' if mean else 'sum'}/{how}", ok,
                              digest=common.digest(np.asarray(got["emb"])),
                              neg_zero_rows=[int(r) for r in (30, 31, 32)
                                             if np.signbit(emb[r]).all()],
                              untouched_zero=bool((np.asarray(emb)[40:] == 0).all()))
                if dtype == "float32" and not mean:
                    found_sum = got if how == "found" else found_sum
                    if how == "given":
                        common.report("given-equals-found",
                                      bits_equal(got["emb"], found_sum["emb"]))
    # Over the bound outside jit: the dense reduction, chosen in Python.
    sparse = herring_jax.allreduce_gradients(sparse_rows=IS_EMB, sparse_max_rows=K)
    dense = herring_jax.allreduce_gradients()
    g = grads_of(rank, n, np.float32, many=rank == 0)
    before = herring_jax.stats()["bytes_reduced"]
    got, _ = sparse.update(g, sparse.init(g))
    reduced = herring_jax.stats()["bytes_reduced"] - before
    want, _ = dense.update(g, dense.init(g))
    common.report("eager-fallback", bits_equal(got["emb"], want["emb"])
                  and reduced >= V * D * 4, bytes_reduced=int(reduced))


def fallback_cases(rank, n):
    sparse = herring_jax.allreduce_gradients(sparse_rows=IS_EMB, sparse_max_rows=K)
    dense = herring_jax.allreduce_gradients()
    g0 = grads_of(rank, n, np.float32)
    s_state, d_state = sparse.init(g0), dense.init(g0)
    sparse_step = jax.jit(lambda g, ids: sparse.update(g, s_state, row_ids=ids)[0])
    dense_step = jax.jit(lambda g: dense.update(g, d_state)[0])
    for t, over in enumerate([False, True, False, True, True, False]):
        many = over and rank == n - 1  # one rank alone goes over the bound
        g = grads_of(rank, n, np.float32, t, many)
        before = herring_jax.stats()["bytes_reduced"]
        got = jax.block_until_ready(sparse_step(g, ids_of(rank, n, t, many)))
        reduced = herring_jax.stats()["bytes_reduced"] - before
        want = dense_step(g)
        ok = bits_equal(got["emb"], want["emb"]) and bits_equal(got["w"], want["w"])
        common.report(f"jit-fallback/step{t}", ok, over=over, bytes_reduced=int(reduced),
                      digest=common.digest(np.asarray(got["emb"])))


class Model(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="emb")(tokens)
        return nn.Dense(3, name="out")(x.mean(axis=1))


def flax_cases(rank, n):
    model = Model()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 5), jnp.int32))

    def train(reduction, use_ids: bool) -> list:
        tx = optax.chain(reduction, optax.adam(0.05))

        @jax.jit
        def step(p, state, tokens, labels):
            def loss(p):
                logits = model.apply(p, tokens)
                return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            g = jax.grad(loss)(p)
            extra = {"row_ids": tokens} if use_ids else {}
            updates, state = tx.update(g, state, p, **extra)
            return optax.apply_updates(p, updates), state

        p, state, seen = params, tx.init(params), []
        for t in range(3):
            rng = np.random.RandomState(100 * t + rank)
            tokens = jnp.asarray(rng.randint(0, V, (2, 5)), jnp.int32)
            labels = jnp.asarray(rng.randint(0, 3, (2,)), jnp.int32)
            p, state = step(p, state, tokens, labels)
            seen.append(jax.tree_util.tree_map(np.asarray, p))
        return seen

    dense = train(herring_jax.allreduce_gradients(), False)
    for how in ("found", "given"):
        sparse = train(herring_jax.allreduce_gradients(sparse_rows=IS_EMB, sparse_max_rows=0.25),
                       how == "given")
        ok = all(bits_equal(a, b) for s, d in zip(sparse, dense)
                 for a, b in zip(jax.tree_util.tree_leaves(s), jax.tree_util.tree_leaves(d)))
        moved = not bits_equal(sparse[-1]["params"]["emb"]["embedding"],
                               params["params"]["emb"]["embedding"])
        common.report(f"flax/{how}", ok and moved, moved=moved,
                      digest=common.digest(sparse[-1]["params"]["emb"]["embedding"]))


def main() -> int:
    herring_jax.initialize()
    rank, n = herring_jax.process_index(), herring_jax.process_count()
    hosts = common.hosts_from_env(n)
    if len(hosts) > 1 and len(hosts[0]) > 1 and common.host_stage_on():
        assert sparse_lib.summation_order() == hosts, (sparse_lib.summation_order(), hosts)
    eager_cases(rank, n, sparse_lib.summation_order())
    fallback_cases(rank, n)
    flax_cases(rank, n)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
