"""Peer `mpi4jax`: mpi4jax.allreduce and allgather under jax.jit, over Open MPI."""

from __future__ import annotations

import numpy as np

from herring_jax._src.tools.bench.peers.base import Peer, check_mpi_world


class Mpi4jaxPeer(Peer):
    label = "mpi4jax.allreduce under jax.jit (Open MPI)"
    labels = {"all_gather": "mpi4jax.allgather under jax.jit (Open MPI)"}
    lacks = {"reduce_scatter": "mpi4jax (0.9) has no reduce-scatter"}
    needs = ("mpi4jax", "mpi4py")
    install = ("apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py mpi4jax "
               "(with nvcc on PATH but no CUDA headers: CUDA_ROOT=<empty dir>)")
    mpi = True

    def __init__(self, rank: int, n: int):
        from mpi4py import MPI
        super().__init__(rank, n)
        check_mpi_world(MPI, rank, n)

    def build(self, collective: str):
        import jax
        import mpi4jax  # the package (absolute import), not this module
        from mpi4py import MPI
        if collective == "all_gather":
            # (n, B) -> the buffer's n*B, as the other peers give it.
            return jax.jit(lambda v: mpi4jax.allgather(v, comm=MPI.COMM_WORLD).reshape(-1))
        return jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=MPI.COMM_WORLD))

    def prepare(self, local: np.ndarray) -> None:
        import jax.numpy as jnp
        self._arg = jnp.asarray(local)
