"""Exit soak: launches a short job many times, its ranks leaving at different
moments, and prints how many launches failed.

  python tests/exit_soak.py [-n 200] [--nproc 4] [--host-stage 0|1|both]
                            [--hog 2] [--jitter-s 0.5] [--steps 6] [--env K=V ...]

Each launch runs tests/workers/leave_worker.py: a few all-reduces whose last
one every rank leaves right after (each rank first sleeping a random 0 to
--jitter-s seconds, drawn per launch), with --hog busy-loop processes beside
it. A launch fails when any rank's reduction fails or sums wrongly, a rank
exits non-zero, or the job runs past its timeout. Prints each failure's
output and, at the end, "failed F / total N" and the time taken; exits 1 if
any launch failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from multiproc import launch  # noqa: E402

HOG = "while True: pass"


def start_hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait()


def failure(run, nproc: int) -> str:
    """Why a launch failed ("" if it did not)."""
    if run.returncode != 0:
        return f"exit code {run.returncode}"
    if sorted(run.results) != list(range(nproc)):
        return f"ranks {sorted(run.results)} reported"
    bad = [(r, res.get("message", "")) for r, rs in run.results.items() for res in rs
           if not res["ok"]]
    return f"failed ranks: {bad}" if bad else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=200, help="launches")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--host-stage", choices=("0", "1", "both"), default="both",
                        help="HERRING_HOST_STAGE of the launches (both: alternating)")
    parser.add_argument("--hog", type=int, default=2, help="busy-loop processes beside")
    parser.add_argument("--jitter-s", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--count", type=int, default=300_000, help="float32 elements reduced")
    parser.add_argument("--env", action="append", default=[], metavar="K=V",
                        help="more environment for the ranks (e.g. HERRING_HEARTBEAT_S=0.05)")
    args = parser.parse_args()
    hogs = start_hogs(args.hog)
    failed = 0
    start = time.monotonic()
    try:
        for i in range(args.n):
            stage = args.host_stage if args.host_stage != "both" else str(i % 2)
            run = launch("leave_worker.py",
                         ["--steps", str(args.steps), "--jitter-s", str(args.jitter_s),
                          "--seed", str(i), "--count", str(args.count)],
                         nproc=args.nproc, timeout=args.timeout,
                         env={"HERRING_HOST_STAGE": stage, "HERRING_TIMEOUT_S": "60",
                              **dict(kv.split("=", 1) for kv in args.env)})
            why = failure(run, args.nproc)
            if why:
                failed += 1
                print(f"launch {i} (HERRING_HOST_STAGE={stage}) failed: {why}\n"
                      f"{run.explain()}", flush=True)
            elif (i + 1) % 10 == 0:
                print(f"{i + 1} launches, {failed} failed, "
                      f"{time.monotonic() - start:.0f} s", flush=True)
    finally:
        stop_hogs(hogs)
    print(f"failed {failed} / total {args.n} in {time.monotonic() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
