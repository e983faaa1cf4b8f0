"""Where a short training script's wall time goes, phase by phase: 10 steps of
a 1.2k-parameter MLP with sharded_optimizer(adamw) (or allreduce_gradients):

  herring-jax launch -n 4 -- python3 -m herring_jax._src.tools.startup_phases
  herring-jax launch -n 2 -- python3 -m herring_jax._src.tools.startup_phases --chain

Rank 0 prints each phase's seconds (the slowest process's, as the job waits
for it): importing jax and herring_jax, initialize(), the optimizer's init
(for sharded_optimizer, its check of the inner transformation), the first
step (compiling it), the other steps, and shutdown(). jax's persistent
compilation cache (JAX_COMPILATION_CACHE_DIR) is turned off by initialize() in
a job of several processes (see joining.turn_off_persistent_cache); the
results are in docs/getting_started.md, "Start-up time".
"""

from __future__ import annotations

import argparse
import time

_T0 = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--chain", action="store_true",
                        help="optax.chain(allreduce_gradients(), adamw) instead of "
                             "sharded_optimizer(adamw)")
    args = parser.parse_args(argv)
    phases = {}
    mark = _T0

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = now - mark
        mark = now

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    lap("import jax, optax")
    import herring_jax
    lap("import herring_jax")
    herring_jax.initialize()
    lap("initialize()")

    sizes = [16, 32, 16, 4]  # 1.2k parameters
    key = jax.random.key(0)
    params = {f"l{i}": {"w": jax.random.normal(jax.random.fold_in(key, i), (a, b)) * 0.1,
                        "b": jnp.zeros(b)}
              for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}
    tx = (optax.chain(herring_jax.allreduce_gradients(), optax.adamw(1e-3)) if args.chain
          else herring_jax.sharded_optimizer(optax.adamw(1e-3)))
    opt_state = tx.init(params)
    jax.block_until_ready(opt_state)
    lap("optimizer init" + ("" if args.chain else " (with its check)"))

    def loss_fn(p, x):
        for i in range(len(sizes) - 1):
            x = x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            x = jnp.tanh(x) if i < len(sizes) - 2 else x
        return jnp.mean(x * x)

    @jax.jit
    def step(p, s, x):
        grads = jax.grad(loss_fn)(p, x)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    rank = herring_jax.process_index()
    for i in range(args.steps):
        x = jnp.asarray(np.random.default_rng(rank * 1000 + i).normal(size=(8, sizes[0])),
                        jnp.float32)
        params, opt_state = step(params, opt_state, x)
        jax.block_until_ready(params)
        if i == 0:
            lap("first step (compile)")
    lap(f"{args.steps - 1} more steps")
    # The slowest process's phases: the job waits for it.
    slowest = np.asarray(herring_jax.allreduce(
        jnp.asarray(list(phases.values()), jnp.float32), op="max"))
    start = time.perf_counter()
    herring_jax.shutdown()
    took = time.perf_counter() - start
    if rank == 0:
        for name, seconds in zip(phases, slowest):
            print(f"{name:32s} {seconds:6.2f} s")
        print(f"{'shutdown() (rank 0)':32s} {took:6.2f} s")
        print(f"{'total (rank 0)':32s} {time.perf_counter() - _T0:6.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
