"""One process's verdict for the job: a check that every process would run
alike, run once.

sharded_optimizer checks at init that its inner transformation is element-
wise, on stand-ins that are the same on every process; run by every process
at once, the check's compiles share the host's cores and each takes as long
as all of them (4 processes on 2 cores: 13 s of a 21 s start). So process 0
runs it and stores the verdict in jax's key-value store; the others wait for
it there and raise the same error, or go on, as process 0 did.

The k-th check of a process is named by k and by a digest of what it checks
(the parameters' structure, shapes and dtypes, the number of workers): a
process whose k-th check differs from process 0's (a program that initialises
other optimizers on other processes) finds no verdict and, after
`WAIT_S`, runs its check itself. So does every process when process 0 never
gives one (it failed otherwise, or checks nothing). Sharing can slow a
start by `WAIT_S` at worst, never make a verdict wrong.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from typing import Callable

from herring_jax._src.process import jax_compat
from herring_jax._src.process import runtime

# How long a process waits for process 0's verdict before it runs the check
# itself: well past the slowest check measured (35 s, clip + adamw, 2
# processes on 2 cores at load 13-25).
WAIT_S = 90.0
_PASSED = "passed"
_FAILED = "failed:"

_counter = itertools.count()
_counter_lock = threading.Lock()
# Counts, for tests and tools: checks this process ran, and verdicts it took
# from process 0.
ran = 0
taken = 0


def _job():
    """(rank, key prefix, the key-value client) in a job of several
    processes, else None."""
    current = runtime.current()
    if current is None or current.size < 2:
        return None
    client = jax_compat.distributed_client()
    if client is None:
        return None
    return current.rank, f"herring_jax/{current.generation}/verdict/", client


def shared(digest: str, check: Callable[[], None]) -> None:
    """Runs `check` (which raises ValueError for a negative verdict) here,
    or takes process 0's verdict of the same check."""
    global ran, taken
    job = _job()
    if job is None:
        ran += 1
        check()
        return
    rank, prefix, client = job
    with _counter_lock:
        k = next(_counter)
    key = prefix + f"{k}-" + hashlib.sha256(digest.encode()).hexdigest()[:24]
    if rank != 0:
        try:
            verdict = client.blocking_key_value_get(key, int(WAIT_S * 1000))
        except Exception:  # noqa: BLE001 - no verdict in time: check here
            verdict = None
        if verdict is not None:
            taken += 1
            if verdict.startswith(_FAILED):
                raise ValueError(verdict[len(_FAILED):])
            return
        ran += 1
        check()
        return
    ran += 1
    try:
        check()
    except ValueError as e:
        _store(client, key, _FAILED + str(e))
        raise
    _store(client, key, _PASSED)


def _store(client, key: str, value: str) -> None:
    try:
        client.key_value_set(key, value)
    except Exception:  # noqa: BLE001 - the others check for themselves after WAIT_S
        pass
