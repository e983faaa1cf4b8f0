"""Shared by the training examples: the data-parallel step over a mesh of all
devices of all processes, reducing gradients with herring_jax or with jax's
own collectives (`--reduce herring|native`)."""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import herring_jax


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reduce", choices=["herring", "native"], default="herring",
                        help="herring: herring_jax.allreduce_gradients; native: jax.lax.pmean")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="examples per device per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)


def setup(args) -> jax.sharding.Mesh:
    if args.reduce == "native":
        # lax.pmean across processes on CPU needs jax's gloo collectives.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    herring_jax.initialize()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices), ("data",))


def make_trainer(mesh, args, loss_fn, init_fn):
    """Returns (params, opt_state, step(params, opt_state, batch) -> (..., loss))."""
    if args.reduce == "herring":
        grad_tx = herring_jax.allreduce_gradients("data")
        mean = herring_jax.pmean
    else:
        grad_tx = optax.GradientTransformation(
            lambda p: optax.EmptyState(), lambda g, s, p=None: (jax.lax.pmean(g, "data"), s))
        mean = jax.lax.pmean
    tx = optax.chain(grad_tx, optax.adamw(args.lr))

    def local_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, mean(loss, "data")

    # check_vma=False: gradients of the replicated parameters stay per-device
    # and the optax transformation averages them (pmap semantics).
    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("data")),
                                 out_specs=(P(), P(), P()), check_vma=False),
                   donate_argnums=(0, 1))
    replicated = NamedSharding(mesh, P())
    params = jax.jit(init_fn, out_shardings=replicated)()
    opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
    return params, opt_state, step


def global_batch(mesh, local_arrays):
    """Each process passes the rows of its own devices."""
    sharding = NamedSharding(mesh, P("data"))
    return tuple(jax.make_array_from_process_local_data(sharding, a) for a in local_arrays)


def train(mesh, args, params, opt_state, step, next_local_batch, report=None):
    """Runs the steps with progress output on rank 0, prints a summary line
    ("done: ...") and shuts herring_jax down; returns (params, losses, step_s)."""
    rank = jax.process_index()
    losses, times = [], []
    for i in range(args.steps):
        batch = global_batch(mesh, next_local_batch(i))
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        loss = float(loss)  # waits for the step
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if rank == 0 and (i % args.log_every == 0 or i == args.steps - 1):
            extra = report(params) if report else ""
            recent = np.median(times[1:][-args.log_every:]) * 1e3 if len(times) > 1 else float("nan")
            print(f"step {i:4d}  loss {loss:.4f}  step {recent:.1f} ms  {extra}", flush=True)
    step_s = float(np.median(times[1:])) if len(times) > 1 else float("nan")
    if rank == 0:
        extra = report(params) if report else ""
        print(f"done: reduce={args.reduce} processes={jax.process_count()} final loss "
              f"{losses[-1]:.4f} (first {losses[0]:.4f}), {extra}, median step "
              f"{step_s * 1e3:.1f} ms", flush=True)
    herring_jax.shutdown()
    return params, losses, step_s
