"""Every process learns every process's outcome of each step of a checkpoint
(done, or the error it raised), through jax.distributed's key-value store.

A barrier cannot carry an error: a process that fails before it leaves the
others waiting there for HERRING_TIMEOUT_S. Here a process that fails
publishes its error and raises at once, and the others raise the same error
as soon as they read it; only a process that dies or hangs is waited for,
and then for HERRING_TIMEOUT_S, naming it.
"""

from __future__ import annotations

import builtins
import collections
import itertools
import json
import time

from herring_jax._src.process import jax_compat
from herring_jax._src.process import knobs
from herring_jax._src.process import runtime
from herring_jax._src.process.errors import HerringError

# Every process calls save_sharded in the same order (it is collective), so
# the count names the same call everywhere and keeps a retry into the same
# directory from reading an earlier call's outcomes. Counted per generation
# of the runtime, which a process that joins later starts with the others.
_calls: dict[int, itertools.count] = collections.defaultdict(itertools.count)
# The calls whose keys rank 0 has not deleted yet. Once a call has completed
# (every process published its last step, so every process is past every
# earlier call), no process reads an earlier call's keys any more.
_undeleted: list[str] = []


class Agreement:
    """The outcomes of one collective call's steps on every process.

    Args:
      what: the call, as error messages name it (``save_sharded('ckpt/7')``).
    """

    def __init__(self, what: str):
        st = runtime.state()
        self.rank, self.size = st.rank, st.size
        self.what = what
        self._prefix = f"herring_jax/{st.generation}/checkpoint/{next(_calls[st.generation])}"
        self._client = jax_compat.distributed_client()
        self._timeout_s = float(knobs.get("HERRING_TIMEOUT_S"))
        if self.rank == 0:
            _undeleted.append(self._prefix)

    def completed(self) -> None:
        """Called once the last step has returned: deletes the keys of the
        calls before this one (rank 0), as nobody reads them any more."""
        if self.rank != 0:
            return
        for prefix in _undeleted[:-1]:
            self._client.key_value_delete(prefix)
        del _undeleted[:-1]

    def step(self, name: str, error: BaseException | None = None, value: str = "") -> list[str]:
        """Publishes this process's outcome of step `name` (`error`, or None
        and a `value` for the others) and waits for every process's.

        Returns:
          Every process's value, in rank order.

        Raises:
          On every process, the same exception for the lowest rank that
          reported a failure (its type where it is a builtin one, else
          HerringError), as soon as it is seen; HerringError naming the
          processes that reported nothing within HERRING_TIMEOUT_S.
        """
        record = {"value": value, "error": None}
        if error is not None:
            record["error"] = [type(error).__name__, str(error) or repr(error)]
        self._client.key_value_set(f"{self._prefix}/{name}/{self.rank}", json.dumps(record))
        if error is not None:
            raise self._exception(self.rank, *record["error"]) from error
        deadline = time.monotonic() + self._timeout_s
        pause = 0.005
        while True:
            seen = {}
            for key, text in self._client.key_value_dir_get(f"{self._prefix}/{name}/"):
                seen[int(key.rsplit("/", 1)[1])] = json.loads(text)
            failed = sorted(r for r, rec in seen.items() if rec["error"] is not None)
            if failed:
                raise self._exception(failed[0], *seen[failed[0]]["error"])
            if len(seen) == self.size:
                return [seen[r]["value"] for r in range(self.size)]
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.size)) - set(seen))
                raise HerringError(
                    f"{self.what}: rank(s) {missing} did not finish step '{name}' within "
                    f"HERRING_TIMEOUT_S={self._timeout_s:g} s (rank {self.rank} waited). A "
                    "process died or hangs, or not every process called it: call it on every "
                    "process, in the same order")
            # Short at first: a failure or the last process usually comes soon.
            time.sleep(pause)
            pause = min(2 * pause, 0.1)

    def _exception(self, rank: int, type_name: str, text: str) -> Exception:
        message = f"{self.what} failed on rank {rank}: {text}"
        cls = getattr(builtins, type_name, None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                return cls(message)
            except TypeError:  # a builtin exception that takes other arguments
                pass
        return HerringError(f"{self.what} failed on rank {rank}: {type_name}: {text}")
