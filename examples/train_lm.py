"""A small Flax transformer language model trained on real text that needs no
download: the Python standard library's own source files, as bytes.

  herring-jax launch -n 4 -- python examples/train_lm.py [--reduce native]
      [--checkpoint-dir /tmp/lm_ckpt]   # saves with orbax; resumes after a crash
      [--time-budget-ms 400 --slow-rank 3 --slowdown 2]   # any-batch (any_batch.py)
"""

from __future__ import annotations

import argparse
import os
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import any_batch
import data_parallel

VOCAB = 256  # bytes


def stdlib_text(max_bytes: int) -> np.ndarray:
    """The standard library's .py files, concatenated in a fixed order."""
    root = pathlib.Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


class Block(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.dim)(h)
        return x + nn.Dense(self.dim)(nn.gelu(h))


class TransformerLM(nn.Module):
    dim: int = 128
    heads: int = 4
    layers: int = 2
    context: int = 64

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, self.dim)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.context, self.dim))
        for _ in range(self.layers):
            x = Block(self.dim, self.heads)(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    data_parallel.add_arguments(parser)
    any_batch.add_arguments(parser)
    parser.add_argument("--text-bytes", type=int, default=4 << 20)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=64)
    parser.set_defaults(batch=16, lr=1e-3)
    args = parser.parse_args()
    mesh = data_parallel.setup(args)
    rank, nproc = jax.process_index(), jax.process_count()

    text = stdlib_text(args.text_bytes)
    held_out = text[-65536:]
    train_text = text[:-65536]
    model = TransformerLM(dim=args.dim, layers=args.layers, context=args.context)
    local_devices = len(mesh.local_devices)

    def windows(source, starts):
        idx = starts[:, None] + np.arange(args.context + 1)
        return source[idx].astype(np.int32)

    def next_local_batch(i):
        # Each process its own windows, a function of the step alone (resume).
        rng = np.random.default_rng([args.seed, rank, i])
        starts = rng.integers(0, len(train_text) - args.context - 1,
                              size=args.batch * local_devices)
        w = windows(train_text, starts)
        return w[:, :-1], w[:, 1:]

    def loss_fn(params, batch):
        logits = model.apply(params, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    eval_batch = windows(held_out, np.arange(0, 64 * 512, 512))
    eval_loss = jax.jit(lambda p: loss_fn(p, (eval_batch[:, :-1], eval_batch[:, 1:])))

    if any_batch.enabled(args):
        any_batch.train(args, loss_fn, lambda: model.init(
            jax.random.key(args.seed), jnp.zeros((1, args.context), jnp.int32)),
            next_local_batch, eval_loss)
        return

    def report(params):
        local = data_parallel.local_params(params, args)
        return f"held-out loss {float(eval_loss(local)):.4f}"

    params, opt_state, step = data_parallel.make_trainer(
        mesh, args, loss_fn,
        lambda: model.init(jax.random.key(args.seed), jnp.zeros((1, args.context), jnp.int32)))
    if rank == 0:
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(
            data_parallel.local_params(params, args)))
        print(f"{n_params / 1e6:.2f} M parameters, {len(text) / 2**20:.1f} MiB of stdlib text, "
              f"{nproc} processes x {local_devices} devices, reduce={args.reduce}", flush=True)
    data_parallel.train(mesh, args, params, opt_state, step, next_local_batch, report)

if __name__ == "__main__":
    main()
