"""Peer `herring`: herring_jax.allreduce under jax.jit, the code under test."""

from __future__ import annotations

import numpy as np

from herring_jax._src.bench.peers.base import Peer


class HerringPeer(Peer):
    label = "herring_jax.allreduce under jax.jit, process-local buffer"

    def __init__(self, rank: int, n: int):
        import jax
        import herring_jax
        super().__init__(rank, n)
        self._fn = jax.jit(lambda v: herring_jax.allreduce(v))

    def prepare(self, local: np.ndarray) -> None:
        import jax.numpy as jnp
        self._arg = jnp.asarray(local)
