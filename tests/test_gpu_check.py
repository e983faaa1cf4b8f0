"""The GPU check's dry run, so that the kit cannot rot between lent GPUs:
`JAX_PLATFORMS=cpu bash tests/gpu/run.sh` goes through every step on CPU
devices with the installed herring_jax, and every step passes or is skipped
for want of CUDA (and says so).

It runs without the prepared .gpu/ folder (GPU_CHECK_PAYLOAD points at an
empty one): prepare.sh downloads ~100 MB and builds for Python 3.12, too much
for the suite. The carried libraries and the prebuilt module are checked by
prepare.sh itself, and by hand with
`bash tests/gpu/prepare.sh && JAX_PLATFORMS=cpu bash tests/gpu/run.sh`.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = ["preflight", "extension", "one-process", "reduce-memory", "reduce-transport",
         "mean-in-place", "identity", "identity-extra-launch", "flax-step", "overlap",
         "halves", "sharded-flax", "halves-timing", "restart", "failures"]
# Not yet run on a GPU: the summary says so.
NEW_STEPS = {"halves", "sharded-flax", "halves-timing", "restart"}


# On CPU beside the rest of the suite the dry run took 460 s of the GPU's
# 480 s budget on a slow 2-core machine (its restart step 232 s of 240), so it
# runs with twice the time: every step's limit doubled, and the budget.
@pytest.mark.timeout(1100)
def test_dry_run_passes_every_step_on_cpu(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", GPU_CHECK_PYTHON=sys.executable,
               GPU_CHECK_PAYLOAD=str(tmp_path / "no-payload"), OUT=str(tmp_path / "out"),
               GPU_CHECK_TIME_SCALE="2", GPU_CHECK_BUDGET_S="1000")
    proc = subprocess.run(["bash", "tests/gpu/run.sh"], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=1060)
    output = proc.stdout + proc.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert proc.returncode == 0, f"{output[-8000:]}\n--- steps.log ---\n" + (
        tmp_path / "out" / "steps.log").read_text()[-8000:]
    lines = {m.group(2): (m.group(1), m.group(3))
             for m in re.finditer(r"^(PASS|WARN|FAIL|SKIP)\s+(\S+)\s+\d+s\s+(.*)$", summary, re.M)}
    assert list(lines) == STEPS, summary
    # On CPU nothing may fail or warn; the steps with CUDA-only parts say what
    # they left out.
    assert all(status == "PASS" for status, _ in lines.values()), summary
    assert "CPU dry run" in lines["preflight"][1], summary
    assert "CPU dry run" in lines["overlap"][1], summary
    assert "installed" in lines["extension"][1], summary
    assert {s for s, (_, text) in lines.items() if text.startswith("[new] ")} == NEW_STEPS, summary
    # The dry run takes the halves through the CPU double's start/done.
    assert "the CPU double" in lines["halves"][1], summary
    # The expected first-run problems are printed for whoever runs it.
    assert "Expected first-run problems" in proc.stdout
    assert (tmp_path / "out" / "logs.tar.gz").exists()
