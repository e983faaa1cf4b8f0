"""Peer `mpi4py`: Open MPI's Allreduce of numpy buffers, through mpi4py."""

from __future__ import annotations

import numpy as np

from herring_jax._src.bench.peers.base import Peer, check_mpi_world


class Mpi4pyPeer(Peer):
    label = "mpi4py Comm.Allreduce of numpy buffers (Open MPI)"
    needs = ("mpi4py",)
    install = "apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py"
    mpi = True

    def __init__(self, rank: int, n: int):
        from mpi4py import MPI  # the package (absolute import), not this module
        super().__init__(rank, n)
        check_mpi_world(MPI, rank, n)
        self._comm, self._sum = MPI.COMM_WORLD, MPI.SUM

    def prepare(self, local: np.ndarray) -> None:
        self._in, self._out = local, np.empty_like(local)

    def run(self):
        self._comm.Allreduce(self._in, self._out, op=self._sum)
        return self._out
