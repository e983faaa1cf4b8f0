"""Preemption: a SIGTERM to any process of the job makes every process stop at
the same step boundary, save there and exit, within a grace period.

Cloud schedulers announce a preemption with SIGTERM to one machine's processes
(spot instances get 30 s to 2 min), Slurm and Kubernetes to every process,
herring-jax launch forwards its own. The processes must agree on where to
stop: one that stops a step earlier than the others leaves them waiting in a
reduction it never joins. Every process therefore calls
``preemption_requested()`` at the same points (after each step), and that call
is one herring all-reduce (max) of a flag: it returns the same answer on every
process, True from the first call after any process got the signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from herring_jax._src.process import knobs

GRACE_ENV = "HERRING_PREEMPTION_GRACE_S"

# How often the watchdog looks at the clock; a polled attribute, not an Event,
# because a signal handler must not take a lock the interrupted code may hold.
_WATCH_S = 0.2


class _Preemption:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signalled_at: float | None = None  # monotonic time of the first signal
        self.signal_name = ""
        self.agreed = False  # preemption_requested() has returned True

    def on_signal(self, signum: int, _frame) -> None:
        if self.signalled_at is not None:
            return
        self.signalled_at = time.monotonic()
        self.signal_name = signal.Signals(signum).name
        # os.write: print() could re-enter the stream the interrupted code was writing.
        os.write(2, (f"herring_jax rank {_rank()}: got {self.signal_name}; every process "
                     f"saves at the next step boundary and exits (within {self.grace_s:g} s, "
                     f"{GRACE_ENV})\n").encode())

    def watch(self) -> None:
        while True:
            time.sleep(_WATCH_S)
            start = self.signalled_at
            if start is not None and time.monotonic() - start > self.grace_s:
                where = ("saving or exiting" if self.agreed else
                         "before every process reached a preemption_requested() call")
                os.write(2, (f"herring_jax rank {_rank()}: the preemption grace of "
                             f"{self.grace_s:g} s ({GRACE_ENV}) ran out {where}; exiting "
                             "with status 1 (a longer grace, or a step boundary reached "
                             "sooner, lets it save)\n").encode())
                os._exit(1)


_installed: _Preemption | None = None


def _rank() -> int:
    # Never imports the runtime (and jax) from a signal handler: that takes seconds.
    runtime = sys.modules.get("herring_jax._src.process.runtime")
    current = runtime.current() if runtime is not None else None
    return current.rank if current is not None else int(os.environ.get("HERRING_PROCESS_ID", 0))


def catch_preemption(grace_s: float | None = None) -> None:
    """Makes SIGTERM ask for a save at the next step boundary instead of
    ending the process at once.

    Call it on every process after ``herring_jax.initialize()`` (which, under
    ``herring-jax launch``, gives SIGTERM its default action back; it replaces
    jax.distributed's preemption notifier too). From the first SIGTERM on,
    ``preemption_requested()`` returns True on every process, and the process
    has ``grace_s`` seconds to save and exit; past them it says so and exits
    with status 1. ``preemption_requested()`` calls it on first use, so
    calling it is only needed to catch a SIGTERM that comes before the first
    step ends. Calling it again changes the grace.

    Args:
      grace_s: seconds from the signal to the process's exit; default
        HERRING_PREEMPTION_GRACE_S (20 s).

    Examples:
      >>> herring_jax.catch_preemption(grace_s=25)  # doctest: +SKIP
    """
    global _installed
    if grace_s is None:
        grace_s = knobs.get(GRACE_ENV)
    if not grace_s > 0:
        raise ValueError(f"grace_s must be positive, got {grace_s}")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("catch_preemption() installs a signal handler: call it from the "
                           "main thread")
    if _installed is not None:
        _installed.grace_s = float(grace_s)
        return
    _installed = _Preemption(float(grace_s))
    signal.signal(signal.SIGTERM, _installed.on_signal)
    threading.Thread(target=_installed.watch, name="herring-preemption-grace",
                     daemon=True).start()


def preemption_requested() -> bool:
    """Whether the job should save now and exit: a collective.

    Every process must call it at the same points of its program (after each
    training step, say), like any other reduction. It returns the same value
    on every process: True from the first call after any process of the job
    got SIGTERM, so that all of them stop after the same step. It costs one
    all-reduce of a 4-byte flag.

    After saving, end the process with ``herring_jax.PREEMPTED_EXIT_CODE``
    (75) rather than 0, so that the launcher and a scheduler's retry loop can
    tell a preempted run, which resumes from its checkpoint, from a finished one.

    Examples:
      >>> for step in range(first, steps):            # doctest: +SKIP
      ...     state = train_step(state, batch(step))
      ...     if herring_jax.preemption_requested():
      ...         save(step + 1, state)
      ...         sys.exit(herring_jax.PREEMPTED_EXIT_CODE)
    """
    # Here, not at the top: the launcher imports this module for
    # PREEMPTED_EXIT_CODE and must start without numpy or jax.
    import numpy as np

    from herring_jax._src.process import runtime
    from herring_jax._src.collectives.allreduce import allreduce

    current = runtime.current()
    if current is None:
        raise RuntimeError("preemption_requested() agrees with the other processes: call "
                           "herring_jax.initialize() first")
    if _installed is None:
        catch_preemption()
    flag = np.int32(_installed.signalled_at is not None)
    if current.size > 1:
        flag = allreduce(flag, "max")
    if int(flag):
        if not _installed.agreed:
            _installed.agreed = True
            if _installed.signalled_at is None:
                # This process got no signal: its grace runs from the agreement.
                _installed.signalled_at = time.monotonic()
        return True
    return False
