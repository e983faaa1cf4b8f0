"""What a new user meets in the first hour of writing a training script
(tests/workers/first_hour_worker.py): one failing rank ends the job in
seconds, naming the exception; shutdown() after queued steps finishes them;
check_vma=True never multiplies the gradients; a mismatch is reported as a
stall, naming both programs' call sites."""

import os
import re
import subprocess
import sys
import time

import pytest

from multiproc import ROOT, assert_all_ok, launch

WORKER = "first_hour_worker.py"


def test_an_exception_on_one_rank_ends_the_job_within_seconds():
    # Rank 1 raises RuntimeError at step 10 of 60 while rank 0 reduces. Before,
    # rank 0 waited in the host stage for the 300 s timeout and rank 1 in
    # jax.distributed's exit-time barrier.
    # Timed from the raise to the launcher's end, so that start-up and
    # compiles on a loaded machine do not count: far below the timeout.
    run = launch(WORKER, ["raise"], nproc=2, env={"HERRING_TIMEOUT_S": "300"}, timeout=240)
    ended = time.time()
    assert run.returncode == 1, run.explain()
    [raised] = run.results[1]
    took = ended - raised["at"]
    assert 0 < took < 60, f"the job ended {took:.0f} s after the raise\n{run.explain()}"
    # The survivor names the rank and its exception, once, as a HerringError.
    survivor = [line for line in run.stderr.splitlines()
                if line.startswith("[rank 0] ") and "HerringError" in line]
    assert survivor, run.explain()
    assert any("rank 1 failed: RuntimeError: bad batch at step 10" in line
               for line in survivor), run.explain()
    assert sum(line.count("rank 1 failed: RuntimeError") for line in survivor) == 1, run.explain()
    # No C++ abort backtrace from jax.distributed's shutdown.
    assert "Check failure" not in run.stderr and "SIGABRT" not in run.stderr, run.explain()


@pytest.mark.parametrize("devices", [1, 2])
def test_shutdown_right_after_the_last_queued_step_finishes_them(devices):
    # 200 jitted steps are dispatched asynchronously; shutdown() follows at
    # once. It must wait for them, and the job must end cleanly (2 x 1: before,
    # half the runs failed after 30 s; 2 x 2 under shard_map hung).
    run = launch(WORKER, ["shutdown"], nproc=2, devices=devices, timeout=240)
    assert_all_ok(run, expected_cases=1)
    assert "rank 1 has sent nothing" not in run.stderr, run.explain()
    assert "could not tell" not in run.stderr, run.explain()


def test_check_vma_true_is_refused_never_multiplied():
    # allreduce_gradients('d') inside shard_map over 4 devices (2 processes x
    # 2): with check_vma=True jax has already summed the replicated
    # parameters' gradients; before, the step moved 4x as far.
    run = launch(WORKER, ["check_vma"], nproc=2, devices=2, timeout=240)
    assert_all_ok(run, expected_cases=3)
    for rank, results in run.results.items():
        by_case = {r["case"]: r for r in results}
        assert "digest" in by_case["check_vma=False"], by_case
        error = by_case["check_vma=True"].get("error", "")
        assert "check_vma=False" in error and "already summed" in error, by_case
        assert "['params']['Dense_0']['kernel']" in error, error


def test_a_batch_size_mismatch_fails_every_rank_in_seconds_naming_both_call_sites():
    # Rank 1 trains on 31 examples, rank 0 on 32: two different programs,
    # whose reductions can never pair. With the default knobs (a 60 s stall
    # report, a 300 s timeout) every rank fails within seconds: the job ends
    # well inside the launch's 120 s.
    run = launch(WORKER, ["mismatch"], nproc=2, timeout=120)
    assert run.returncode != 0, run.explain()
    errors = [line for line in run.stderr.splitlines() if "herring_jax.HerringError: " in line]
    assert {int(m) for line in errors for m in re.findall(r"^\[rank (\d)\]", line)} == {0, 1}, \
        run.explain()
    assert all("compiled different programs" in line and "a batch of another size" in line
               for line in errors), run.explain()
    # The gradients agree in shape: the same call, another executable.
    assert any("this same call under another run id" in line for line in errors), run.explain()
    # The error names where both ranks wait in the script.
    # ("at first_hour_worker.py:60 (make_step.<locals>.step)" on either side.)
    assert any(len(re.findall(r"at first_hour_worker\.py:\d+ \(", line)) >= 2
               for line in errors), run.explain()


def test_broadcast_of_different_trees_names_the_leaf():
    run = launch(WORKER, ["broadcast"], nproc=2, env={"HERRING_TIMEOUT_S": "60"},
                 timeout=120)
    assert run.returncode != 0, run.explain()
    assert "['params']['Dense_0']['kernel']" in run.stderr, run.explain()
    assert "float32[20,72]" in run.stderr and "float32[20,64]" in run.stderr, run.explain()


def test_errors_name_the_bound_axes_and_the_leaf_paths():
    run = launch(WORKER, ["friction"], nproc=2, timeout=120)
    assert_all_ok(run, expected_cases=5)


def test_a_plain_python_run_is_a_job_of_one_process(tmp_path):
    # No launcher, no cluster: jax.distributed alone asks for a coordinator.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HERRING_", "JAX_COORD"))}
    script = tmp_path / "train.py"
    script.write_text(
        "import jax.numpy as jnp, herring_jax\n"
        "herring_jax.initialize()\n"
        "print('result', herring_jax.process_count(), herring_jax.allreduce(jnp.ones(3)).tolist())\n")
    proc = subprocess.run([sys.executable, "-P", str(script)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "result 1 [1.0, 1.0, 1.0]" in proc.stdout, proc.stdout + proc.stderr
    assert "herring-jax launch -n N -- python train.py" in proc.stderr, proc.stderr


def test_the_rank_asked_before_initialize_under_the_launcher_is_an_error():
    code = ("import herring_jax\n"
            "try:\n"
            "    herring_jax.process_index()\n"
            "except herring_jax.HerringError as e:\n"
            "    assert 'initialize() first' in str(e), e\n"
            "    print('refused')\n")
    proc = subprocess.run([sys.executable, "-P", "-m", "herring_jax.launch", "-n", "2", "--",
                           sys.executable, "-P", "-c", code],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("refused") == 2, proc.stdout + proc.stderr


def test_importing_the_source_checkout_without_a_build_says_what_to_do():
    # The checkout's herring_jax/ (no compiled extension) shadows the installed one.
    proc = subprocess.run([sys.executable, "-c", "import herring_jax"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "source checkout" in proc.stderr and "python -P" in proc.stderr, proc.stderr
    assert "circular import" not in proc.stderr.splitlines()[-1], proc.stderr
