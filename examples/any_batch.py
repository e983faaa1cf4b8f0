"""Any-batch training (distributed any-batch mirror descent) for the training
examples: every process gets the same time per step, takes as many
micro-batches as fit in it, and the step weights each process's gradient by
the examples it used (herring_jax.allreduce_gradients(weight=True)), so that a
slow process takes fewer examples instead of making every other one wait.

  herring-jax launch -n 4 -- python examples/train_lm.py --time-budget-ms 400 \\
      --slow-rank 3 --slowdown 2            # any-batch, process 3 twice as slow
  herring-jax launch -n 4 -- python examples/train_lm.py --micro-batches 4 \\
      --slow-rank 3 --slowdown 2            # the synchronous job: 4 each, all wait

One device per process (the processes are the workers, Horovod style).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import herring_jax

# Micro-batch k of step i reads the batch of index i * STRIDE + k.
STRIDE = 1 << 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--time-budget-ms", type=float, default=0.0,
                        help="any-batch: each process takes micro-batches of --batch examples "
                             "until the next would not fit in this many ms (at least one), and "
                             "the step weights its mean gradient by its examples (0: off)")
    parser.add_argument("--micro-batches", type=int, default=0,
                        help="the synchronous job of the same loop: every process takes this "
                             "many micro-batches a step, and the step (a plain mean) waits "
                             "for the slowest")
    parser.add_argument("--slow-rank", type=int, default=-1,
                        help="with --time-budget-ms or --micro-batches: this process is slow")
    parser.add_argument("--slowdown", type=float, default=1.0,
                        help="--slow-rank's factor: after each micro-batch it sleeps "
                             "(slowdown - 1) times the micro-batch's compute time")


def enabled(args) -> bool:
    if args.time_budget_ms and args.micro_batches:
        raise SystemExit("--time-budget-ms and --micro-batches are two modes: give one")
    if (args.time_budget_ms < 0 or args.micro_batches < 0 or args.slowdown < 1):
        raise SystemExit("--time-budget-ms, --micro-batches >= 0 and --slowdown >= 1")
    return bool(args.time_budget_ms or args.micro_batches)


def train(args, loss_fn, init_fn, next_local_batch, held_out_loss) -> None:
    """The any-batch (or fixed micro-batch) loop; prints a line per
    --log-every steps on rank 0 and a "done:" summary."""
    if jax.local_device_count() != 1:
        raise SystemExit("--time-budget-ms / --micro-batches run one device per process")
    if args.reduce != "herring" or args.checkpoint_dir:
        raise SystemExit("--time-budget-ms / --micro-batches take --reduce herring and no "
                         "--checkpoint-dir")
    rank = jax.process_index()
    weighted = args.time_budget_ms > 0
    optimizer = (optax.sgd(args.lr, momentum=0.9) if args.optimizer == "sgd"
                 else optax.adamw(args.lr))
    tx = optax.chain(herring_jax.allreduce_gradients(weight=weighted), optimizer)
    params = jax.jit(init_fn)()
    opt_state = tx.init(params)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    add = jax.jit(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b))

    def apply(params, opt_state, grads, k, examples):
        # The process's mean gradient over its k micro-batches, weighted by
        # its examples (the synchronous job: a plain mean).
        grads = jax.tree_util.tree_map(lambda g: g / k, grads)
        extra = {"weight": examples} if weighted else {}
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    update = jax.jit(apply, donate_argnums=(0, 1))
    slow = rank == args.slow_rank and args.slowdown > 1
    budget = args.time_budget_ms / 1e3
    times, computes, seen, mine = [], [], 0, []
    for i in range(args.steps):
        start = time.perf_counter()
        k, total = 0, None
        while True:
            t0 = time.perf_counter()
            _, g = grad_fn(params, next_local_batch(i * STRIDE + k))
            jax.block_until_ready(g)
            if slow:
                time.sleep((args.slowdown - 1) * (time.perf_counter() - t0))
            total = g if total is None else add(total, g)
            k += 1
            elapsed = time.perf_counter() - start
            if (k >= args.micro_batches if not weighted
                    else elapsed + elapsed / k > budget):
                break
        computes.append(time.perf_counter() - start)
        params, opt_state = update(params, opt_state, total, jnp.float32(k),
                                   jnp.float32(k * args.batch))
        jax.block_until_ready(params)
        times.append(time.perf_counter() - start)
        mine.append(k)
        if i % args.log_every == 0 or i == args.steps - 1:
            # Every process reduces its count (the same steps on every one).
            seen = int(herring_jax.allreduce(np.int64(sum(mine) * args.batch)))
            if rank == 0:
                print(f"step {i:4d}  examples seen {seen}  held-out loss "
                      f"{float(held_out_loss(params)):.4f}  step "
                      f"{np.median(times[1:][-args.log_every:] or times) * 1e3:.1f} ms", flush=True)
    per_rank = herring_jax.allgather(np.float64(np.mean(mine)))
    if rank == 0:
        print(f"done: {'any-batch' if weighted else 'synchronous'} processes="
              f"{jax.process_count()} slow rank {args.slow_rank} x{args.slowdown:g}, median step "
              f"{np.median(times[1:]) * 1e3:.1f} ms (compute {np.median(computes[1:]) * 1e3:.1f}"
              f" ms), micro-batches per step by rank "
              f"{' '.join(f'{v:.2f}' for v in np.asarray(per_rank))}, examples seen {seen}, "
              f"held-out loss {float(held_out_loss(params)):.4f}, wall {sum(times):.1f} s",
              flush=True)
    herring_jax.shutdown()
