"""What every peer of `herring-jax bench` is: the Peer interface, and the
helpers the peers share."""

from __future__ import annotations

import numpy as np

# The workers' keys in jax.distributed's key-value store start with this.
KV_PREFIX = "herring_jax_bench"
KV_TIMEOUT_MS = 600_000


class Peer:
    """One implementation of the collectives, timed on the same buffers as the others.

    configure() runs before jax.distributed starts (backend choices must
    precede it); __init__(rank, n) builds what does not depend on the size;
    use(collective) picks the collective (collectives.py) of the runs that
    follow; prepare(local) takes this process's input; run() runs the
    collective and blocks; result(out) is this process's result as numpy.

    `label` says what runs for an all-reduce, `labels` for each other
    collective the peer has; `lacks` says why it has none of another.

    A peer that needs packages names them in `needs` and says how to get
    them in `install`; `mpi = True` makes the driver start the workers with
    mpirun.
    """

    label = ""
    labels: dict[str, str] = {}
    lacks: dict[str, str] = {}
    needs: tuple[str, ...] = ()
    install = ""
    mpi = False

    @staticmethod
    def configure() -> None:
        pass

    def __init__(self, rank: int, n: int):
        self._fn = self._arg = None
        self.collective = "allreduce"
        self._fns: dict = {}

    @classmethod
    def has(cls, collective: str) -> bool:
        return collective == "allreduce" or collective in cls.labels

    @classmethod
    def describe(cls, collective: str) -> str:
        """What runs for `collective`, or why nothing does."""
        if cls.has(collective):
            return cls.label if collective == "allreduce" else cls.labels[collective]
        return cls.lacks.get(collective, f"has no {collective}")

    def use(self, collective: str) -> None:
        """Untimed: the collective of the runs that follow; its function is
        built (and, under jit, compiled at the first run) once."""
        self.collective = collective
        if collective not in self._fns:
            self._fns[collective] = self.build(collective)
        self._fn = self._fns[collective]

    def build(self, collective: str):
        """The function run() calls for `collective` (None: run() does it all)."""
        return None

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
