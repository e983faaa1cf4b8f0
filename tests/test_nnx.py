"""Flax NNX (tests/workers/nnx_worker.py, on 2 processes): allreduce_gradients,
sharded_optimizer, the bf16 codec with error feedback, PowerSGD and top-k
inside nnx.Optimizer under nnx.jit, each bitwise the same transformation used
on a plain pytree; allreduce_gradients bitwise one process's training on
every rank's gradients; sharded_optimizer bitwise the unsharded chain; bf16
within the worker's stated tolerance of exact gradients; and the NNX
checkpoint recipes of docs/guides/checkpoints.md resuming bitwise, each file
written by one process, and onto 3 processes. And examples/train_nnx.py: 2 processes equal one
process's NNX training within float32 rounding, bitwise on every process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from multiproc import BITWISE_COMPILE, assert_all_ok, assert_each_file_has_one_writer, launch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Bitwise comparisons across programs: see the worker's docstring.
# HERRING_HOST_STAGE=0: a codec applies where data crosses the transport.
ENV = {"XLA_FLAGS": BITWISE_COMPILE, "HERRING_HOST_STAGE": "0"}
CASES = ["allreduce/nnx-vs-plain", "bf16/nnx-vs-plain", "powersgd/nnx-vs-plain",
         "topk/nnx-vs-plain", "sharded/nnx-vs-plain", "allreduce/one-process",
         "sharded/vs-chain", "bf16/vs-exact", "checkpoint/sharded", "checkpoint/plain"]


def test_herring_inside_nnx_optimizer_on_two_processes(tmp_path):
    run = launch("nnx_worker.py", ["--dir", str(tmp_path)], nproc=2, env=ENV)
    digests = assert_all_ok(run, expected_cases=len(CASES))
    by_case = {r["case"]: r for r in run.results[0]}
    assert sorted(by_case) == sorted(CASES), sorted(by_case)
    # Every rank ends with the same parameters in every case.
    assert all(len(d) == 1 for d in digests.values()), digests
    for case, r in by_case.items():
        if case.endswith("nnx-vs-plain"):
            assert r["loss_falls"], (case, r["losses"])
            # PowerSGD and top-k compressed something (else they warn).
            assert not r["warnings"], (case, r["warnings"])
    for kind in ("sharded", "plain"):
        r = by_case[f"checkpoint/{kind}"]
        assert (r["step"], r["final_step"]) == (2, 4), r
    # The checkpoints' files: each written by one process, none through a
    # writable memory map, and each process wrote some.
    assert_each_file_has_one_writer(run, tmp_path, ("checkpoint/sharded",))
    # Saved on 2, restored on 3: sharded_optimizer's checkpoint resumes
    # bitwise as the plain chain's does.
    resumed = launch("nnx_worker.py", ["--dir", str(tmp_path), "--resume"], nproc=3, env=ENV)
    digests = assert_all_ok(resumed, expected_cases=2)
    assert len(set().union(*digests.values())) == 1, digests


def _example(args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HERRING_TIMEOUT_S="120")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "herring_jax.launch", "-n", "2", "--timeout", "300", "--",
           sys.executable, "train_nnx.py", "--steps", "30", *args]
    return subprocess.run(cmd, cwd=EXAMPLES, env=env, capture_output=True, text=True,
                          timeout=330)


@pytest.mark.parametrize("args", [[], ["--sharded"]], ids=["allreduce", "sharded"])
def test_the_nnx_example_matches_one_process(args):
    proc = _example(args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    [verdict] = [l for l in proc.stdout.splitlines() if "within float32 rounding" in l]
    assert "OK: the parameters equal one process's training" in verdict, verdict
    assert "bitwise equal on 2 of 2 processes" in verdict, verdict
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert last < first, proc.stdout[-2000:]
