"""Any-batch training (distributed any-batch mirror descent) for the training
examples: every process gets the same time per step, takes as many
micro-batches as fit in it, and the step weights each process's gradient by
the examples it used (herring_jax.allreduce_gradients(weight=True)), so that a
slow process takes fewer examples instead of making every other one wait.

  herring-jax launch -n 4 -- python examples/train_lm.py --time-budget-ms 400 \\
      --slow-rank 3 --slowdown 2            # any-batch, process 3 twice as slow
  herring-jax launch -n 4 -- python examples/train_lm.py --micro-batches 4 \\
      --slow-rank 3 --slowdown 2            # the synchronous job: 4 each, all wait
  herring-jax launch -n 4 -- python examples/train_lm.py --micro-batches 4 --any-batch \\
      --slow-rank 3 --slowdown 2            # any-batch, the budget: the fastest's 4

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
                             "while at least half of the next one fits in this many ms (at "
                             "least one), and "
                             "the step weights its mean gradient by its examples (0: off)")
    parser.add_argument("--micro-batches", type=int, default=0,
                        help="the synchronous job of the same loop: every process takes this "
                             "many micro-batches a step, and the step (a plain mean) waits "
                             "for the slowest")
    parser.add_argument("--any-batch", action="store_true",
                        help="with --micro-batches K: any-batch, the budget of each step the "
                             "time the fastest process took for K micro-batches at the step "
                             "before (the first two steps take K everywhere), so that it follows "
                             "the machine's load")
    parser.add_argument("--slow-rank", type=int, default=-1,
                        help="with --time-budget-ms or --micro-batches: this process is slow")
    parser.add_argument("--slowdown", type=float, default=1.0,
                        help="--slow-rank's factor: after each micro-batch it sleeps "
                             "(slowdown - 1) times the micro-batch's compute time")


def enabled(args) -> bool:
    if args.time_budget_ms and args.micro_batches:
        raise SystemExit("--time-budget-ms and --micro-batches are two modes: give one")
    if args.any_batch and not args.micro_batches:
        raise SystemExit("--any-batch takes --micro-batches K (the fastest process's count)")
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
    weighted = args.time_budget_ms > 0 or args.any_batch
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
    fixed = args.micro_batches if not args.time_budget_ms else 0
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
            # Another micro-batch while at least half of it (at this step's
            # mean) still fits: the budget's count, rounded to the nearest.
            if (k >= fixed if fixed else elapsed + 0.5 * elapsed / k > budget):
                break
        computes.append(time.perf_counter() - start)
        if args.any_batch and i >= 1:
            # The next step's budget: K micro-batches of the fastest process
            # (its mean micro-batch time this step), the same on every one.
            # Steps 0 and 1 take K everywhere: step 0 compiles.
            fixed = 0
            per_micro = herring_jax.allreduce(np.float32(computes[-1] / k), op="min")
            budget = args.micro_batches * float(per_micro)
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
