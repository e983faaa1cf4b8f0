"""The GPU check's restart step; checks.py runs it as its own (`python
tests/gpu/checks.py restart`). New since the check last ran on a GPU: run.sh
marks its summary line "[new]".

  restart: examples/train_lm.py on 2 ranks sharing the GPU, 8 steps, once
    uninterrupted and once with rank 1 SIGKILLed after
    step 5 under `herring-jax launch --max-restarts 1`: the launcher restarts
    both, they resume from the checkpoint after step 4 (every 4 steps), and the final
    parameters' sha256 is the uninterrupted run's. allreduce_gradients with
    orbax's checkpoints where orbax is installed, else fully_sharded with
    herring_jax.save_sharded's (which needs nothing else).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checks import RANK_ENV, summary

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LM_ARGS = ["--steps", "8", "--log-every", "100", "--dim", "32", "--layers", "1",
           "--context", "16", "--batch", "8", "--text-bytes", str(1 << 17),
           "--checkpoint-every", "4"]
KILL = "5:1"  # after step 5, rank 1: the checkpoint after step 4 is the latest
DIGEST = re.compile(r"params sha256 ([0-9a-f]{16})")
RESUMED = re.compile(r"\] resumed from the checkpoint after step (\d+)")


def _mode() -> tuple[list[str], str]:
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError:
        return ["--fully-sharded"], "fully_sharded, save_sharded's checkpoints (no orbax here)"
    return [], "allreduce_gradients, orbax's checkpoints"


def _train(ckpt: str, launch: list[str], extra: list[str]) -> subprocess.CompletedProcess:
    # run.sh's GPU_CHECK_TIME_SCALE (the CPU dry run on a slow machine).
    scale = int(os.environ.get("GPU_CHECK_TIME_SCALE", "1"))
    cmd = [sys.executable, "-m", "herring_jax.launch", "-n", "2", "--timeout", str(150 * scale),
           *launch,
           "--", sys.executable, "train_lm.py", *LM_ARGS, "--checkpoint-dir", ckpt, *extra]
    print("-- " + " ".join(cmd), flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=EXAMPLES, env={**os.environ, **RANK_ENV,
                                                  "HERRING_LAUNCH_GRACE_S": "5"},
                          capture_output=True, text=True, timeout=200 * scale)
    print(f"   exit {proc.returncode} after {time.monotonic() - start:.1f} s\n"
          f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", flush=True)
    return proc


def restart() -> int:
    extra, what = _mode()
    with tempfile.TemporaryDirectory(prefix="herring-gpu-restart-") as tmp:
        whole = _train(f"{tmp}/whole", [], extra)
        if whole.returncode != 0:
            return summary("FAIL", f"{what}: the uninterrupted run exited {whole.returncode}")
        killed = _train(f"{tmp}/killed", ["--max-restarts", "1"],
                        [*extra, "--kill-at-step", KILL])
    if killed.returncode != 0:
        return summary("FAIL", f"{what}: the run killed once under --max-restarts 1 exited "
                       f"{killed.returncode}")
    want, got = DIGEST.findall(whole.stdout), DIGEST.findall(killed.stdout)
    restarted = ": restart 1 of 1 " in killed.stderr
    resumed = [int(s) for s in RESUMED.findall(killed.stdout)]
    problems = []
    if not restarted:
        problems.append("the launcher did not restart the job")
    if resumed != [4]:
        problems.append(f"resumed after steps {resumed}, not after step 4")
    if len(want) != 1 or got != want:
        problems.append(f"params sha256 {got} against the uninterrupted {want}")
    if problems:
        return summary("FAIL", f"{what}: " + "; ".join(problems))
    return summary("PASS", f"{what}: rank 1 killed after step 5, restarted, resumed after "
                   f"step 4, params sha256 {want[0]} as uninterrupted")


STEPS = {"restart": restart}
