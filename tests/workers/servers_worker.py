"""A job whose server-only process is killed while the workers reduce.

Usage (under the launcher, with --servers 1 and HERRING_TEST_SERVER_EXIT_S;
HERRING_TEST_RANK0_FAULT sets rank 0's HERRING_TEST_FAULT):
  python tests/workers/servers_worker.py

Each worker reduces 1 MiB of float32 through herring_jax.allreduce until a
reduction fails, and reports the error and how long after its last success
the failure came.
"""

from __future__ import annotations

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402


def _end(ok: bool, **fields) -> None:
    """Reports the run and ends the process at once with status 1, skipping
    the exit handlers (common.report has flushed the line)."""
    common.report("killed-server", ok, **fields)
    os._exit(1)


def main() -> int:
    # The launcher sends SIGTERM a moment after the server died; this report
    # is what is under test, so the worker lets its reduction fail first (a
    # Python handler runs once the main thread is back in Python).
    signal.signal(signal.SIGTERM, lambda *_: None)
    # HERRING_TEST_RANK0_FAULT: rank 0's HERRING_TEST_FAULT (the others have none).
    if os.environ.get("HERRING_PROCESS_ID") == "0":
        os.environ["HERRING_TEST_FAULT"] = os.environ.get("HERRING_TEST_RANK0_FAULT", "")
    herring_jax.initialize()
    x = np.ones(1 << 18, np.float32)
    steps = 0
    last = time.monotonic()
    deadline = last + 100
    try:
        with herring_jax.herring_errors():
            while time.monotonic() < deadline:
                out = float(np.asarray(herring_jax.allreduce(x))[0])
                if out != herring_jax.process_count():
                    _end(False, steps=steps, message=f"wrong sum {out} after {steps} steps")
                steps += 1
                last = time.monotonic()
    except herring_jax.HerringError as e:
        _end(True, steps=steps, seconds=time.monotonic() - last, message=str(e)[:1500])
    except Exception as e:  # noqa: BLE001 - reported: the test names what else came
        _end(False, steps=steps,
             message=f"{type(e).__name__} instead of HerringError: {str(e)[:1500]}")
    common.report("killed-server", False, steps=steps, message="no error")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
