"""What every peer of `herring-jax bench` is: the Peer interface, and the
helpers the peers share."""

from __future__ import annotations

import numpy as np

# The workers' keys in jax.distributed's key-value store start with this.
KV_PREFIX = "herring_jax_bench"
KV_TIMEOUT_MS = 600_000


class Peer:
    """One all-reduce implementation, timed on the same buffers as the others.

    configure() runs before jax.distributed starts (backend choices must
    precede it); __init__(rank, n) builds what does not depend on the size;
    prepare(local) takes this process's buffer; run() reduces it and blocks;
    result(out) is this process's copy of the sum as numpy.

    A peer that needs packages names them in `needs` and says how to get
    them in `install`; `mpi = True` makes the driver start the workers with
    mpirun.
    """

    label = ""
    needs: tuple[str, ...] = ()
    install = ""
    mpi = False

    @staticmethod
    def configure() -> None:
        pass

    def __init__(self, rank: int, n: int):
        self._fn = self._arg = None

    def prepare(self, local: np.ndarray) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Untimed, before each run: restores the input of an in-place peer."""

    def run(self):
        import jax
        return jax.block_until_ready(self._fn(self._arg))

    @staticmethod
    def result(out) -> np.ndarray:
        return np.asarray(out)


def check_mpi_world(MPI, rank: int, n: int) -> None:
    """Fails unless MPI's world is the jax processes, in the same order."""
    world = MPI.COMM_WORLD
    if world.Get_size() != n or world.Get_rank() != rank:
        raise SystemExit(f"MPI rank {world.Get_rank()} of {world.Get_size()} is not jax "
                         f"process {rank} of {n}: start the workers with mpirun")
