"""A Flax MLP on scikit-learn's handwritten digits (8x8 images, shipped with
the package), data-parallel over processes with herring_jax.

  herring-jax launch -n 4 -- python examples/train_mnist_like.py [--reduce native]
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import data_parallel


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128)(x))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(10)(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    data_parallel.add_arguments(parser)
    args = parser.parse_args()
    mesh = data_parallel.setup(args)
    rank, nproc = jax.process_index(), jax.process_count()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(args.seed).permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
    # Each process draws from its own shard of the training set.
    shard = slice(rank * len(x_train) // nproc, (rank + 1) * len(x_train) // nproc)
    xs, ys = x_train[shard], y_train[shard]
    local_devices = len(mesh.local_devices)

    def loss_fn(params, batch):
        logits = MLP().apply(params, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    def next_local_batch(i):
        rng = np.random.default_rng([args.seed, rank, i])  # a function of the step (resume)
        idx = rng.integers(0, len(xs), size=args.batch * local_devices)
        return xs[idx], ys[idx]

    accuracy = jax.jit(lambda p: jnp.mean(jnp.argmax(MLP().apply(p, x_test), -1) == y_test))

    def report(params):
        # This process's own copy: under --local-steps the parameters carry a
        # leading axis of one per device.
        local = data_parallel.local_params(params, args)
        return f"test accuracy {float(accuracy(local)):.3f}"

    params, opt_state, step = data_parallel.make_trainer(
        mesh, args, loss_fn, lambda: MLP().init(jax.random.key(args.seed), x[:1]))
    data_parallel.train(mesh, args, params, opt_state, step, next_local_batch, report)

if __name__ == "__main__":
    main()
