"""Failures must raise HerringError on every surviving rank, never hang or
return a wrong sum.

  mismatch: two ranks reduce different shapes at the same call site; both
    must fail at once (the detecting rank tells the others).
  dead-peer: rank 1 leaves right after initialize(); rank 0 must fail within
    HERRING_TIMEOUT_S, naming rank 1.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402


def dead_peer(rank: int) -> None:
    if rank == 1:
        os._exit(0)  # exit 0 so that the launcher does not stop rank 0 itself
    start = time.monotonic()
    try:
        herring_jax.allreduce(np.ones(1000, np.float32))
    except herring_jax.HerringError as e:
        named = "rank(s) [1]" in str(e) or "rank 1" in str(e)
        common.report("dead-peer", named, seconds=time.monotonic() - start,
                      message=str(e)[:600])
    else:
        common.report("dead-peer", False, message="no error")


def main() -> int:
    herring_jax.initialize()
    rank = herring_jax.process_index()
    if sys.argv[1:] == ["dead-peer"]:
        dead_peer(rank)
        sys.stdout.flush()
        os._exit(0)
    x = np.ones(1000 + rank * 24, np.float32)  # rank 1 reduces 24 more elements
    start = time.monotonic()
    try:
        herring_jax.allreduce(x)
    except herring_jax.HerringError as e:
        common.report("mismatch", True, seconds=time.monotonic() - start, message=str(e)[:600])
    else:
        common.report("mismatch", False, message="no error")
    # The communicator refuses further reductions with the original reason.
    try:
        herring_jax.allreduce(np.ones(4, np.float32))
    except herring_jax.HerringError as e:
        common.report("after-failure", "earlier failure" in str(e), message=str(e)[:300])
    else:
        common.report("after-failure", False, message="no error")
    sys.stdout.flush()
    os._exit(0)  # skip jax.distributed's shutdown barrier: the job is broken


if __name__ == "__main__":
    sys.exit(main())
