"""tests/test_recipes.py's job: initialize() with no arguments, one reduction."""

import jax.numpy as jnp

import herring_jax

herring_jax.initialize()
rank, n = herring_jax.process_index(), herring_jax.process_count()
total = herring_jax.allreduce(jnp.full(3, rank + 1.0))
print(f"recipe rank {rank} of {n}: {float(total[0])}", flush=True)
herring_jax.shutdown()
