"""Peer `mpi4py`: Open MPI's Allreduce, Reduce_scatter_block and Allgather of
numpy buffers, through mpi4py."""

from __future__ import annotations

import numpy as np

from herring_jax._src.tools.bench.peers.base import Peer, check_mpi_world


class Mpi4pyPeer(Peer):
    label = "mpi4py Comm.Allreduce of numpy buffers (Open MPI)"
    labels = {"reduce_scatter": "mpi4py Comm.Reduce_scatter_block of numpy buffers (Open MPI)",
              "all_gather": "mpi4py Comm.Allgather of numpy buffers (Open MPI)"}
    needs = ("mpi4py",)
    install = "apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py"
    mpi = True

    def __init__(self, rank: int, n: int):
        from mpi4py import MPI  # the package (absolute import), not this module
        super().__init__(rank, n)
        check_mpi_world(MPI, rank, n)
        self._n, self._comm, self._sum = n, MPI.COMM_WORLD, MPI.SUM

    def prepare(self, local: np.ndarray) -> None:
        size = {"allreduce": local.size, "reduce_scatter": local.size // self._n,
                "all_gather": local.size * self._n}[self.collective]
        self._in, self._out = local, np.empty(size, local.dtype)

    def run(self):
        if self.collective == "reduce_scatter":
            self._comm.Reduce_scatter_block(self._in, self._out, op=self._sum)
        elif self.collective == "all_gather":
            self._comm.Allgather(self._in, self._out)
        else:
            self._comm.Allreduce(self._in, self._out, op=self._sum)
        return self._out
