"""A failing job's last words: every rank's report printed before jax ends it.

jax.distributed's coordination service runs in process 0. When that process
exits, jax ends every other process at once with a fatal error of its own
("Terminating process because the JAX distributed service detected fatal
errors", a C++ stack): a rank that was about to print why it failed (its
HerringError naming the rank that failed first) prints that instead. So at
a fast exit after an uncaught exception (errors.exit_now):

- every rank says in jax's key-value store that it is ending, once its report
  is printed (say_ending);
- process 0 then waits, at most LINGER_S, until each other rank has said so,
  or has left no report to wait for: its process on this host has exited
  (SIGKILL, a crash) (outlive_the_others).

A rank whose program is busy outside herring_jax (it learns of the failure
at its next reduction) holds process 0 up to LINGER_S; the launcher's SIGTERM
still ends the job after its own settle time.
"""

from __future__ import annotations

import threading
import time

from herring_jax._src.process import jax_compat

# Longest process 0 outlives itself at a fast exit, waiting for the others'
# reports.
LINGER_S = 5.0
# Longest any rank waits for its "ending" to be stored.
SAY_S = 1.0
_POLL_S = 0.02


def _key(generation: int) -> str:
    return f"herring_jax/{generation}/ending/"


def say_ending(generation: int, rank: int, wait_s: float = SAY_S) -> None:
    """This rank's report is printed: process 0 need not wait for it. Waits
    at most `wait_s` for the key to be stored: where process 0 is gone
    already, the request could wait out gRPC's own timeout, and this process
    must end now."""
    client = jax_compat.distributed_client()
    if client is None:
        return
    stored = threading.Event()

    def store():
        try:
            client.key_value_set(f"{_key(generation)}{rank}", "1")
        except Exception:  # noqa: BLE001 - the service may be gone already; exit anyway
            pass
        finally:
            stored.set()

    threading.Thread(target=store, name="herring_jax-last-words", daemon=True).start()
    stored.wait(wait_s)


def process_exited(pid: int) -> bool:
    """Whether process `pid` (of this pid namespace) has exited: gone, a
    zombie, or tearing its threads down (no memory left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            line = f.read()
    except OSError:
        return True
    # "pid (comm) state ...": comm may hold spaces and parentheses.
    fields = line[line.rfind(")") + 2:].split()
    if not fields:
        return False
    # fields[20] is vsize (the 23rd field of the line): 0 once killed.
    return fields[0] in ("Z", "X") or (len(fields) > 20 and fields[20] == "0")


def outlive_the_others(generation: int, rank: int, size: int, topology,
                       linger_s: float = LINGER_S) -> float:
    """In the process that hosts jax's coordination service: waits until
    every other rank has said it is ending or its process on this host has
    exited, at most `linger_s`. Returns the seconds waited."""
    if size < 2 or not jax_compat.hosts_coordination_service():
        return 0.0
    client = jax_compat.distributed_client()
    if client is None:
        return 0.0
    start = time.monotonic()
    waiting = set(range(size)) - {rank}
    while waiting and time.monotonic() - start < linger_s:
        try:
            said = {int(key.rsplit("/", 1)[1]) for key, _ in client.key_value_dir_get(_key(generation))}
        except Exception:  # noqa: BLE001 - nothing more to learn; exit
            break
        waiting -= said
        if topology is not None:
            waiting = {r for r in waiting
                       if not (topology.host_of[r] == topology.host_of[rank]
                               and process_exited(topology.pid_of[r]))}
        if waiting:
            time.sleep(_POLL_S)
    return time.monotonic() - start
