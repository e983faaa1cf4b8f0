"""What `herring-jax launch --max-restarts K [--min-processes M]` does after a
failed run: whether to start the job again, on which hosts, and the line that
says so. Pure bookkeeping; launch.py starts and stops the processes.

A host is the unit that can be left out: one process without --netns, the
--processes-per-host P processes of one simulated host with it. Hosts keep the
number they had in the first run (their "slot"), so that a host that fails
again after its ranks were renumbered is still recognised.
"""

from __future__ import annotations

import dataclasses

RESTART_ENV = "HERRING_RESTART"
# A host that fails in this many runs in a row is left out (with --min-processes).
FAILURES_IN_A_ROW = 2


def _processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


@dataclasses.dataclass
class Restarts:
    """The restart budget and the hosts still in the job.

    Attributes:
      hosts: the first run's number of hosts.
      per_host: processes per host.
      max_restarts: K, how many times the job may be started again.
      min_processes: M, the fewest processes to continue on (None: always
        restart on every host).
    """

    hosts: int
    per_host: int
    max_restarts: int
    min_processes: int | None = None

    def __post_init__(self):
        self.restart = 0  # the run about to start (0: the first)
        self.slots = list(range(self.hosts))  # the hosts of the next run, by first-run number
        self._last_failed: int | None = None  # slot that failed the previous run
        self._in_a_row = 0

    @property
    def num_processes(self) -> int:
        return len(self.slots) * self.per_host

    def slot_of(self, rank: int) -> int:
        """The first-run host number of `rank` in the current run."""
        return self.slots[rank // self.per_host]

    def after_failure(self, rank: int, why: str) -> str | None:
        """Records that `rank` ended the current run (`why`: how it ended).

        Returns:
          The launcher's line for the restart, or None when the budget is spent
          (the job ends with the failure).
        """
        if self.restart >= self.max_restarts:
            return None
        slot = self.slot_of(rank)
        self._in_a_row = self._in_a_row + 1 if slot == self._last_failed else 1
        self._last_failed = slot
        self.restart += 1
        head = f"restart {self.restart} of {self.max_restarts} ({RESTART_ENV}={self.restart}): "
        if self.per_host > 1:
            named = f"rank {rank} (on host {slot})"
        elif slot != rank:
            named = f"rank {rank} (rank {slot} of the first run)"
        else:
            named = f"rank {rank}"
        fewer = self.num_processes - self.per_host
        if (self.min_processes is not None and self._in_a_row >= FAILURES_IN_A_ROW
                and fewer >= self.min_processes):
            self.slots.remove(slot)
            self._last_failed, self._in_a_row = None, 0
            left = "host" if self.per_host > 1 else "process"
            return (f"{head}{named} {why}, in {FAILURES_IN_A_ROW} runs in a row: leaving its "
                    f"{left} out and continuing on {_processes(fewer)} (--min-processes "
                    f"{self.min_processes}; ranks renumbered from 0)")
        return f"{head}{named} {why}; starting all {_processes(self.num_processes)} again"

    def after_server_failure(self, who: str, why: str) -> str | None:
        """Like after_failure, for a server-only process (`who` names it): the
        whole job starts again on the same hosts (servers are never left out)."""
        if self.restart >= self.max_restarts:
            return None
        self.restart += 1
        return (f"restart {self.restart} of {self.max_restarts} ({RESTART_ENV}={self.restart}): "
                f"{who} {why}; starting all {_processes(self.num_processes)} again, and the "
                "servers")
