"""examples/train_lm.py checkpoints with orbax: a job whose process is killed
mid-run and is then relaunched resumes from the latest checkpoint and ends
with bitwise the same parameters as a run that was never interrupted."""

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ARGS = ["--steps", "12", "--log-every", "1", "--dim", "32", "--layers", "1",
        "--text-bytes", str(1 << 18), "--checkpoint-every", "4"]


def _launch(ckpt: Path, extra=()):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HERRING_TIMEOUT_S="60")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "herring_jax.launch", "-n", "2", "--timeout", "240", "--",
           sys.executable, "train_lm.py", *ARGS, "--checkpoint-dir", str(ckpt), *extra]
    return subprocess.run(cmd, cwd=EXAMPLES, env=env, capture_output=True, text=True,
                          timeout=300)


def _digest(proc) -> str:
    m = re.search(r"params sha256 ([0-9a-f]{16})", proc.stdout)
    assert m, proc.stdout[-3000:] + proc.stderr[-3000:]
    return m.group(1)


def test_killed_run_resumes_to_the_same_parameters(tmp_path):
    whole = _launch(tmp_path / "whole")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]

    killed = _launch(tmp_path / "resumed", ["--kill-at-step", "6"])
    out = killed.stdout + killed.stderr
    assert killed.returncode != 0, out[-3000:]
    assert "killing process 1 after step 6" in out and "SIGKILL" in out, out[-3000:]
    assert "done:" not in killed.stdout, out[-3000:]
    saved = sorted(int(p.name) for p in (tmp_path / "resumed").iterdir() if p.name.isdigit())
    assert saved == [4], saved  # the checkpoint after step 8 was never reached

    resumed = _launch(tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from the checkpoint after step 4" in resumed.stdout, resumed.stdout[-3000:]
    # Steps 4..11 ran again, nothing before.
    steps = [int(s) for s in re.findall(r"\] step\s+(\d+)\s+loss", resumed.stdout)]
    assert steps == list(range(4, 12)), steps
    assert _digest(resumed) == _digest(whole)
    # The uninterrupted run's own loss at step 11 is reproduced exactly.
    last = re.compile(r"\] step\s+11\s+loss ([\d.]+)")
    assert last.search(resumed.stdout).group(1) == last.search(whole.stdout).group(1)
