"""A recommendation-style model whose bytes are one large embedding table:
each example is a user's recent items and a candidate item, the label
whether the user clicks it. A step touches the rows of the items in its
batch, a few percent of the table, so the table's gradient can be reduced
as sparse rows (only the touched rows cross the network).

  herring-jax launch -n 4 -- python examples/train_recsys.py [--sparse]

The clicks come from a hidden model of the same form (fixed by --seed): item
popularity follows a Zipf law, and a user clicks a candidate close to the
items they had. With --sparse the result is bitwise that of the dense run:
the same held-out loss, in less time per step where the network is slow.
"""

from __future__ import annotations

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import herring_jax


class Recommender(nn.Module):
    items: int
    dim: int

    @nn.compact
    def __call__(self, history, candidate):
        table = nn.Embed(self.items, self.dim, name="items")
        user = table(history).mean(axis=1)
        x = jnp.concatenate([user, table(candidate), user * table(candidate)], axis=-1)
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(1)(x)[:, 0]


def clicks(rng: np.random.Generator, n: int, items: int, history: int, truth: np.ndarray):
    """n examples drawn from the hidden model: (history ids, candidate ids, labels)."""
    ranks = np.arange(1, items + 1, dtype=np.float64)
    popularity = 1.0 / ranks ** 1.05
    popularity /= popularity.sum()
    hist = rng.choice(items, (n, history), p=popularity).astype(np.int32)
    cand = rng.choice(items, n, p=popularity).astype(np.int32)
    score = np.einsum("nd,nd->n", truth[hist].mean(axis=1), truth[cand]) * 4.0
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-score))).astype(np.float32)
    return hist, cand, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--items", type=int, default=131072)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--history", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128, help="examples per process per step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sparse", action="store_true",
                        help="reduce the item table's gradient as sparse rows")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()

    truth = np.random.default_rng(args.seed).normal(0, 1, (args.items, 8)).astype(np.float32)
    model = Recommender(args.items, args.dim)
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, args.history), jnp.int32),
                        jnp.zeros((1,), jnp.int32))
    per_step = args.batch * (args.history + 1)  # ids a step looks up: the bound
    if args.sparse:
        reduction = herring_jax.allreduce_gradients(
            sparse_rows=lambda path, g: "items" in jax.tree_util.keystr(path),
            sparse_max_rows=per_step)
    else:
        reduction = herring_jax.allreduce_gradients()
    tx = optax.chain(reduction, optax.adagrad(args.lr))
    opt_state = tx.init(params)

    def loss_fn(p, hist, cand, labels):
        return optax.sigmoid_binary_cross_entropy(model.apply(p, hist, cand), labels).mean()

    @jax.jit
    def step(p, state, hist, cand, labels):
        loss, grads = jax.value_and_grad(loss_fn)(p, hist, cand, labels)
        extra = ({"row_ids": jnp.concatenate([hist.reshape(-1), cand])} if args.sparse else {})
        updates, state = tx.update(grads, state, p, **extra)
        return optax.apply_updates(p, updates), state, loss

    held_out = clicks(np.random.default_rng([args.seed, 10**6]), 4096, args.items, args.history,
                      truth)
    eval_loss = jax.jit(lambda p: loss_fn(p, *held_out))
    times, sent = [], []
    for i in range(args.steps):
        batch = clicks(np.random.default_rng([args.seed, rank, i]), args.batch, args.items,
                       args.history, truth)
        before = herring_jax.stats()["bytes_sent"]
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, *batch)
        loss = float(loss)
        if i >= 2:  # after compiling
            times.append(time.perf_counter() - start)
            sent.append(herring_jax.stats()["bytes_sent"] - before)
        if rank == 0 and (i + 1) % args.log_every == 0:
            print(f"step {i + 1} loss {loss:.4f} held-out loss {float(eval_loss(params)):.4f}",
                  flush=True)
    if rank == 0:
        print(f"done: {'sparse' if args.sparse else 'dense'} {nproc} processes, held-out loss "
              f"{float(eval_loss(params)):.6f}, step {1e3 * statistics.median(times):.1f} ms "
              f"(median), sent {statistics.median(sent) / 2**20:.2f} MiB per step", flush=True)
    herring_jax.shutdown()


if __name__ == "__main__":
    main()
