"""Time from a kill to the first step after the restart, with its parts
(BENCHMARKS.md, "Restarts"): examples/train_lm.py on 4 processes under
`herring-jax launch --max-restarts K`, one rank SIGKILLed once per run.

  python3 -P tests/restart_bench.py [--kills 10] [--reduce herring native]

Every line of the job is stamped when the launcher writes it; the parts are
  detect:  the kill to the launcher's line naming the dead rank, written once
           the survivors have ended by themselves (herring's peer-death error)
           or 3 s have passed,
  stop:    that line to its restart line (SIGTERM, HERRING_LAUNCH_GRACE_S = 5 s
           here, SIGKILL: what is left after the survivors' own exit),
  start:   the restart line to "resumed from the checkpoint" (the processes'
           start, jax's import, initialize(), the model's init, the restore),
  compile: that line to the first step's line (the step's compile and run, and
           rank 0's held-out loss).
--reduce native averages with jax.lax.pmean over jax.distributed's gloo
collectives, under the same launcher: what jax.distributed alone gives.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
_KILL = re.compile(r"^\[rank \d+\] killing process \d+ after step \d+")
_DEAD = re.compile(r"^herring-jax launch: rank \d+ exited with code")
_RESTART = re.compile(r"^herring-jax launch: restart \d+ of")
_RESUMED = re.compile(r"^\[rank 0\] resumed from the checkpoint")
_STEP = re.compile(r"^\[rank 0\] step\s+\d+\s+loss")


def measure(reduce: str, kills: int, every: int = 2) -> list[dict[str, float]]:
    """Runs one job with `kills` restarts; returns each restart's parts (s)."""
    plan = ",".join(str(2 + every * k) for k in range(kills))  # each after a checkpoint
    steps = 2 + every * kills + 2
    with tempfile.TemporaryDirectory() as ckpt:
        cmd = [sys.executable, "-m", "herring_jax.launch", "-n", "4", "--max-restarts",
               str(kills), "--timeout", "3000", "--", sys.executable, "train_lm.py",
               "--reduce", reduce, "--steps", str(steps), "--log-every", "1", "--dim", "32",
               "--layers", "1", "--text-bytes", str(1 << 18), "--checkpoint-every",
               str(every), "--checkpoint-dir", ckpt, "--kill-at-step", plan]
        env = dict(os.environ, JAX_PLATFORMS="cpu", HERRING_LAUNCH_GRACE_S="5")
        proc = subprocess.Popen(cmd, cwd=EXAMPLES, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        stamped = [(time.monotonic(), line.rstrip("\n")) for line in proc.stdout]
        if proc.wait() != 0:
            sys.exit(f"the job failed ({proc.returncode}):\n" +
                     "\n".join(line for _, line in stamped[-40:]))
    rows, current = [], None
    for t, line in stamped:
        if _KILL.match(line):
            current = {"kill": t}
        elif current is None:
            continue
        elif _DEAD.match(line) and "dead" not in current:
            current["dead"] = t
        elif _RESTART.match(line):
            current["restart"] = t
        elif _RESUMED.match(line):
            current["resumed"] = t
        elif _STEP.match(line) and "resumed" in current:
            rows.append({"detect": current["dead"] - current["kill"],
                         "stop": current["restart"] - current["dead"],
                         "start": current["resumed"] - current["restart"],
                         "compile": t - current["resumed"],
                         "total": t - current["kill"]})
            current = None
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--reduce", nargs="+", default=["herring", "native"])
    args = parser.parse_args()
    parts = ("detect", "stop", "start", "compile", "total")
    print(f"| reduce | kills | {' | '.join(parts)} (median s) | total min / max |")
    print("|---|---|" + "---|" * len(parts) + "---|")
    for reduce in args.reduce:
        rows = measure(reduce, args.kills)
        med = [statistics.median(r[p] for r in rows) for p in parts]
        totals = [r["total"] for r in rows]
        print(f"| {reduce} | {len(rows)} | " + " | ".join(f"{m:.2f}" for m in med) +
              f" | {min(totals):.2f} / {max(totals):.2f} |", flush=True)


if __name__ == "__main__":
    main()
