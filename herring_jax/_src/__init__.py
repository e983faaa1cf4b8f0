"""Implementation of herring_jax. Everything here is private; import from herring_jax.

One subpackage per concern, imports running one way, bottom first
(tests/test_layout.py checks it):

  process/      the process runtime: knobs, errors, jax shim, engine start-up, topology
  launcher/     `herring-jax launch`, its restarts and simulated hosts (process only)
  collectives/  allreduce, reduce_scatter, the lax drop-ins, their lowering and codecs
  transforms/   the optax gradient transformations built on the collectives
  checkpoints/  save_sharded / restore_sharded and the preemption agreement
  tools/        the benchmarks and their workers
  cli.py        the `herring-jax` command, which dispatches to all of the above
"""
