"""How a rank ends after an uncaught exception with the default fast exit
(HERRING_FAST_EXIT=1): what its timeline holds, and its exit status.

  timeline-failing: both ranks reduce float32[1000]; then rank 1 reduces
    float32[2000], which rank 0 never joins: it fails at HERRING_TIMEOUT_S,
    uncaught (HerringError). Rank 1's trace must hold both slices, the
    failed one marked so.
  timeline-pending: both ranks reduce float32[1000]; rank 1 then starts a
    reduction of float32[3000] on another thread, which rank 0 never joins,
    and while it is in flight raises ValueError; its trace must hold that
    reduction, failed by its own abort.
  sigint: both ranks reduce float32[1000]; then rank 1 gets SIGINT: its
    uncaught KeyboardInterrupt must end it as Python's would, by SIGINT.
  owed-abort: rank 1's first reduction fails at once (HERRING_TEST_FAULT
    abort-at-start), its abort left to a server thread that runs 2 s late
    (slow-server-threads), and the HerringError goes uncaught; rank 0, in
    that reduction, must still be told why before rank 1's process ends.
In each, rank 0 sleeps until the launcher stops it, so that rank 1 ends by
its own exit, not by the launcher's SIGTERM.

The worker stretches the timeline's periodic append to an hour, so that only
the exit's own flush can have written the last slices.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

import herring_jax
from herring_jax._src.process import timeline


def main() -> int:
    case = sys.argv[1]
    timeline._PERIOD_S = 3600.0
    if case == "owed-abort" and os.environ.get("HERRING_PROCESS_ID") == "1":
        os.environ["HERRING_TEST_FAULT"] = "abort-at-start,slow-server-threads"
    herring_jax.initialize()
    rank = herring_jax.process_index()
    if case == "owed-abort" and rank == 0:
        try:
            herring_jax.allreduce(np.ones(1000, np.float32))
        except herring_jax.HerringError:
            pass  # its stderr line is what the test reads
        time.sleep(120)
    herring_jax.allreduce(np.ones(1000, np.float32))  # owed-abort: raises on rank 1
    if rank == 0:
        time.sleep(120)
    elif case == "timeline-failing":
        herring_jax.allreduce(np.ones(2000, np.float32))  # raises HerringError
    elif case == "timeline-pending":
        # On a thread of its own (XLA:CPU runs the call on the caller's).
        threading.Thread(target=herring_jax.allreduce, args=(np.ones(3000, np.float32),),
                         daemon=True).start()
        time.sleep(1.0)  # well inside the reduction, which waits for rank 0
        raise ValueError("rank 1 gives up with a reduction in flight")
    elif case == "sigint":
        os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt
        time.sleep(60)
    print(f"exit_worker: rank {rank} was not ended by case {case}", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
