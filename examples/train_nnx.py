"""A Flax NNX model trained data-parallel with herring_jax, checked against
the same training on one process.

  herring-jax launch -n 4 -- python examples/train_nnx.py [--steps 100] [--sharded]

The NNX way, as Flax's documentation teaches it: ``nnx.Optimizer(model, tx,
wrt=nnx.Param)``, a step under ``nnx.jit`` that calls
``optimizer.update(model, grads)``. herring_jax only changes `tx`:
``optax.chain(herring_jax.allreduce_gradients(), optax.adamw(...))`` averages
the gradients across processes (``--sharded``:
``herring_jax.sharded_optimizer(optax.adamw(...))``, 1/N of adamw's state on
each process). Every step draws one global batch of scikit-learn's digits;
process r trains on its r-th slice. Averaged slice gradients are the global
batch's gradient, so the parameters must equal one process's NNX training on
the whole global batches, up to float32 rounding, and be bitwise the same on
every process.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import herring_jax


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)  # herring_jax averages the gradients here
    return loss


def global_batches(args, nproc: int):
    """Every step's global batch: a function of the seed and the step only,
    so every process and the reference see the same."""
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
    for step in range(args.steps):
        rows = np.random.default_rng([args.seed, step]).integers(0, len(x), args.batch * nproc)
        yield x[rows], y[rows]


def train(args, tx, nproc: int, mine: slice):
    model = MLP(nnx.Rngs(args.seed))  # the same key: the same start everywhere
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    losses = [float(train_step(model, optimizer, x[mine], y[mine]))
              for x, y in global_batches(args, nproc)]
    return nnx.state(model, nnx.Param), losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32, help="examples per process per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharded", action="store_true",
                        help="herring_jax.sharded_optimizer in place of the chain")
    args = parser.parse_args()
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    adamw = optax.adamw(args.lr)
    tx = (herring_jax.sharded_optimizer(adamw) if args.sharded
          else optax.chain(herring_jax.allreduce_gradients(), adamw))
    params, losses = train(args, tx, nproc, slice(rank * args.batch, (rank + 1) * args.batch))
    root = herring_jax.broadcast(nnx.as_pure(params), root=0)
    mine = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(root)))
    equal_ranks = int(herring_jax.allreduce(jnp.int32(mine)))
    ok = equal_ranks == nproc
    if rank == 0:
        print(f"trained {args.steps} steps on {nproc} processes "
              f"({'sharded_optimizer' if args.sharded else 'allreduce_gradients'}): rank 0's loss "
              f"{losses[0]:.4f} -> {losses[-1]:.4f}; training the reference on one process",
              flush=True)
        # One process, the whole global batch, plain adamw: no herring_jax.
        reference, _ = train(args, adamw, nproc, slice(None))
        worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)))
        scale = max(float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(reference))
        # Float32 rounding: the slices' gradients are summed in another order
        # than the global batch's, and adamw carries the last bits along.
        ulps = worst / float(np.spacing(np.float32(scale)))
        close = ulps <= 64
        ok &= close
        print(f"{'OK' if ok else 'FAILED'}: the parameters {'equal' if close else 'DIFFER from'}"
              f" one process's training within float32 rounding ({ulps:.1f} units in the last "
              f"place of the largest parameter; at most 64 allowed) and are bitwise equal on "
              f"{equal_ranks} of {nproc} processes", flush=True)
    herring_jax.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
