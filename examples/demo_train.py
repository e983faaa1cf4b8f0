"""The main demo: a Flax MLP trained data-parallel with herring_jax, checked
against the same training on one process.

  herring-jax launch -n 4 -- python examples/demo_train.py [--steps 200] [--plot loss.png]

Every step draws one global batch of scikit-learn's handwritten digits (the
same on every process); process r trains on its r-th slice, and
``optax.chain(herring_jax.allreduce_gradients(), optax.sgd(...))`` averages
the gradients across processes. Averaged slice gradients are the global
batch's gradient, so at the end the parameters must equal those of plain
jax/optax training on the whole global batch in one process, up to float32
rounding (the sums run in another order), and be bitwise the same on every
process (herring's sums are). Rank 0 prints progress, checks both, and draws
the loss curves.
"""

from __future__ import annotations

import argparse
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import herring_jax


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


def loss_fn(params, x, y):
    logits = MLP().apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64, help="examples per process per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="herring_demo_loss.png",
                        help="loss-curve PNG that rank 0 writes ('' for none)")
    return parser.parse_args()


def global_batches(args, nproc: int):
    """Yields (x, y) of every step's global batch: a function of the seed and
    the step only, so that every process and the reference see the same."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    for step in range(args.steps):
        rows = np.random.default_rng([args.seed, step]).integers(0, len(x),
                                                                 args.batch * nproc)
        yield x[rows], y[rows]


def train_herring(args, rank: int, nproc: int, params):
    """Data-parallel training; returns (params, losses, step seconds)."""
    tx = optax.chain(herring_jax.allreduce_gradients(), optax.sgd(args.lr, momentum=0.9))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        # The global batch's loss: the mean of the slices' (equal sizes).
        return optax.apply_updates(params, updates), opt_state, herring_jax.allreduce(
            loss, op="mean")

    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    losses, seconds = [], []
    reduced_before = herring_jax.stats()["bytes_reduced"]
    for i, (x, y) in enumerate(global_batches(args, nproc)):
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, x[mine], y[mine])
        losses.append(float(loss))  # waits for the step
        seconds.append(time.perf_counter() - start)
        if rank == 0 and (i % args.log_every == 0 or i == args.steps - 1):
            reduced = herring_jax.stats()["bytes_reduced"] - reduced_before
            print(f"step {i:4d}  loss {losses[-1]:.4f}  step {seconds[-1] * 1e3:7.1f} ms  "
                  f"reduced {reduced / 2**20:8.2f} MiB so far "
                  f"({reduced / (i + 1) / 2**10:.0f} KiB per step)", flush=True)
    return params, losses, seconds


def train_reference(args, nproc: int, params):
    """The same training with plain jax and optax on one process: the whole
    global batch, no herring_jax."""
    tx = optax.sgd(args.lr, momentum=0.9)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for x, y in global_batches(args, nproc):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    return params, losses


def same_bits_everywhere(params) -> int:
    """How many processes hold bitwise rank 0's parameters."""
    root = herring_jax.broadcast(params, root=0)
    mine = all(np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(root)))
    return int(herring_jax.allreduce(jnp.int32(mine)))


def plot(path: str, losses: list[float], reference: list[float], nproc: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(reference, color="#999999", lw=4, label="one process, plain optax (reference)")
    ax.plot(losses, color="#e07b39", lw=1.5,
            label=f"{nproc} processes, herring_jax.allreduce_gradients")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.set_yscale("log")
    ax.set_title("herring_jax demo: MLP on scikit-learn digits")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    if rank == 0:
        print(herring_jax.describe(), flush=True)
        print(f"training a {args.batch * nproc}-example global batch per step on {nproc} "
              f"processes ({args.batch} each) for {args.steps} steps", flush=True)
    # The same initial parameters everywhere: the same key.
    init = MLP().init(jax.random.key(args.seed), jnp.zeros((1, 64), jnp.float32))
    params, losses, seconds = train_herring(args, rank, nproc, init)
    equal_ranks = same_bits_everywhere(params)
    ok = equal_ranks == nproc
    if rank == 0:
        print(f"median step {np.median(seconds[1:]) * 1e3:.1f} ms (the first, compiling, "
              f"{seconds[0]:.2f} s); training the reference on one process", flush=True)
        reference, reference_losses = train_reference(args, nproc, init)
        worst, scale = 0.0, 0.0
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
            a, b = np.asarray(a), np.asarray(b)
            worst = max(worst, float(np.max(np.abs(a - b))))
            scale = max(scale, float(np.max(np.abs(b))))
        # Float32 rounding: the slices' gradients are summed in another order
        # than the global batch's, and the steps carry the last bits along.
        # Measured: a few units in the last place of the largest parameter.
        ulps = worst / float(np.spacing(np.float32(scale)))
        close = ulps <= 64
        ok &= close
        print(f"{'OK' if ok else 'FAILED'}: after {args.steps} steps the parameters "
              f"{'equal' if close else 'DIFFER from'} one process's training on the same "
              f"global batches within float32 rounding (largest difference {worst:.1e}, "
              f"{ulps:.1f} units in the last place of the largest parameter; at most 64 "
              f"allowed) and are bitwise equal on {equal_ranks} of {nproc} processes",
              flush=True)
        if args.plot:
            plot(args.plot, losses, reference_losses, nproc)
            print(f"loss curve: {args.plot}", flush=True)
    herring_jax.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
