"""Restarts and preemption: `herring-jax launch --max-restarts K
[--min-processes M]`, herring_jax.preemption_requested, and
examples/train_lm.py resuming from its orbax checkpoints after real kills.

The launcher's own tests run `python -c` children (no jax, a few seconds);
the training ones (extended tier, tests/conftest.py) launch train_lm on 4
processes and compare the params sha256 of its "done" line with an
uninterrupted run's.
"""

import fcntl
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from multiproc import BITWISE_COMPILE

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"
LM_ARGS = ["--steps", "16", "--log-every", "1", "--dim", "32", "--layers", "1",
           "--text-bytes", str(1 << 18), "--checkpoint-every", "4"]


def _launcher(args, cwd=TESTS):
    return [sys.executable, "-m", "herring_jax.launch", *args]


def _run(args, env=None, timeout=120, cwd=TESTS):
    full = {**os.environ, "HERRING_LAUNCH_GRACE_S": "2", **(env or {})}
    return subprocess.run(_launcher(args), env=full, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, check=False)


# Each child appends "run rank n slot" to DIR/log, then fails as FAIL says:
# FAIL(run, rank, n) -> None (success), an exit code, or "kill" (SIGKILL).
_CHILD = textwrap.dedent("""
    import os, sys, time
    run = int(os.environ["HERRING_RESTART"])
    rank = int(os.environ["HERRING_PROCESS_ID"])
    n = int(os.environ["HERRING_NUM_PROCESSES"])
    with open(os.path.join(DIR, "log"), "a") as f:
        f.write(f"{run} {rank} {n}\\n")
    what = FAIL(run, rank, n)
    if what == "kill":
        os.kill(os.getpid(), 9)
    if what is not None:
        sys.exit(what)
    time.sleep(0.3)
""")


def _child(tmp_path, fail: str) -> str:
    return f"DIR = {str(tmp_path)!r}\nFAIL = {fail}\n" + _CHILD


def _runs(tmp_path) -> dict[int, list[tuple[int, int]]]:
    """run number -> sorted [(rank, n)] of the processes that started in it."""
    runs: dict[int, list[tuple[int, int]]] = {}
    for line in (tmp_path / "log").read_text().split("\n"):
        if line:
            run, rank, n = map(int, line.split())
            runs.setdefault(run, []).append((rank, n))
    return {k: sorted(v) for k, v in runs.items()}


def _launcher_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("herring-jax launch: ")]


def test_a_failed_run_restarts_the_whole_job_and_says_why(tmp_path):
    # Rank 1 exits 3 in the first run, rank 0 is SIGKILLed in the second, the third succeeds.
    fail = ("lambda run, rank, n: 3 if (run, rank) == (0, 1) else "
            "'kill' if (run, rank) == (1, 0) else None")
    p = _run(["-n", "3", "--max-restarts", "3", "--", sys.executable, "-c",
              _child(tmp_path, fail)])
    assert p.returncode == 0, p.stderr
    assert _runs(tmp_path) == {k: [(0, 3), (1, 3), (2, 3)] for k in range(3)}
    restarts = [line for line in _launcher_lines(p.stderr) if "restart " in line]
    assert restarts == [
        "herring-jax launch: restart 1 of 3 (HERRING_RESTART=1): rank 1 exited with code 3; "
        "starting all 3 processes again",
        "herring-jax launch: restart 2 of 3 (HERRING_RESTART=2): rank 0 exited with code 137 "
        "(killed by SIGKILL); starting all 3 processes again"], p.stderr


def test_a_rank_killed_by_a_signal_is_named_over_a_peer_that_exited_first(tmp_path):
    # A SIGKILLed rank's peers fail within a moment (herring's peer-death
    # error, status 1); on a busy machine the launcher can see one of them end
    # first. Here rank 0 exits 1 first on purpose, and rank 2 is SIGKILLed
    # 0.3 s later, before the launcher stops anyone: rank 2 is the cause.
    code = textwrap.dedent(f"""
        import os, sys, time
        run, rank = os.environ["HERRING_RESTART"], os.environ["HERRING_PROCESS_ID"]
        flag = os.path.join({str(tmp_path)!r}, "rank0-exits")
        if run == "0" and rank == "0":
            open(flag, "w").close()
            sys.exit(1)
        if run == "0" and rank == "2":
            while not os.path.exists(flag):
                time.sleep(0.01)
            time.sleep(0.3)
            os.kill(os.getpid(), 9)
        time.sleep(0.5 if run == "1" else 30)
    """)
    p = _run(["-n", "3", "--max-restarts", "1", "--", sys.executable, "-c", code])
    assert p.returncode == 0, p.stderr
    restarts = [line for line in _launcher_lines(p.stderr) if "restart " in line]
    assert restarts == [
        "herring-jax launch: restart 1 of 1 (HERRING_RESTART=1): rank 2 exited with code 137 "
        "(killed by SIGKILL); starting all 3 processes again"], p.stderr


def test_the_job_ends_with_the_last_failure_once_the_restarts_are_spent(tmp_path):
    p = _run(["-n", "2", "--max-restarts", "2", "--", sys.executable, "-c",
              _child(tmp_path, "lambda run, rank, n: 5 if rank == 1 else None")])
    assert p.returncode == 5, p.stderr
    assert sorted(_runs(tmp_path)) == [0, 1, 2]  # the first run and two restarts, no more
    lines = _launcher_lines(p.stderr)
    assert sum("restart " in line for line in lines) == 2, lines
    assert lines[-1] == ("herring-jax launch: giving up: the job failed again after 2 restarts "
                         "(--max-restarts)"), lines


def test_a_run_that_saved_for_a_preemption_exits_75_and_is_not_restarted(tmp_path):
    # Rank 1 exits with PREEMPTED_EXIT_CODE (saved for a preemption), rank 0
    # with 0: the launcher says so and exits 75, which a retry loop tells from
    # success (0) and failure; --max-restarts leaves it to the scheduler.
    from herring_jax._src.process.exit_status import PREEMPTED_EXIT_CODE
    assert PREEMPTED_EXIT_CODE == 75
    p = _run(["-n", "2", "--max-restarts", "2", "--", sys.executable, "-c",
              _child(tmp_path, "lambda run, rank, n: 75 if rank == 1 else None")])
    assert p.returncode == 75, p.stderr
    assert sorted(_runs(tmp_path)) == [0], p.stderr  # no restart
    lines = _launcher_lines(p.stderr)
    assert lines == ["herring-jax launch: the ranks saved for a preemption and exited with 75; "
                     "resume from the checkpoint (no restart under --max-restarts: the "
                     "scheduler requeues a preempted job)"], p.stderr
    # A failure beside it is still a failure, and restarted.
    (tmp_path / "second").mkdir()
    q = _run(["-n", "2", "--max-restarts", "1", "--", sys.executable, "-c",
              _child(tmp_path / "second", "lambda run, rank, n: 75 if rank == 1 else "
                     "(4 if run == 0 else None)")])
    assert q.returncode == 75, q.stderr
    assert any("restart 1 of 1" in line for line in _launcher_lines(q.stderr)), q.stderr


def test_a_process_that_keeps_failing_is_left_out_down_to_min_processes(tmp_path):
    # The first run's rank 3 fails from its first restart on, for good; after
    # it is left out (two failures in a row), the next in line (rank 2) fails
    # twice too, but 2 processes are the minimum: it is restarted as it is.
    fail = "lambda run, rank, n: 1 if run >= 1 and rank == n - 1 and n > 2 else " \
           "('kill' if (run, rank) == (0, 3) else None)"
    p = _run(["-n", "4", "--max-restarts", "5", "--min-processes", "2", "--",
              sys.executable, "-c", _child(tmp_path, fail)])
    assert p.returncode == 0, p.stderr
    runs = _runs(tmp_path)
    # 4, 4 (rank 3 fails again: 2 in a row) -> 3, 3 (rank 2 twice) -> 2.
    assert [len(runs[k]) for k in sorted(runs)] == [4, 4, 3, 3, 2], runs
    assert all(runs[k] == [(r, len(runs[k])) for r in range(len(runs[k]))] for k in runs)
    lines = [line for line in _launcher_lines(p.stderr) if "restart " in line]
    assert lines[1] == (
        "herring-jax launch: restart 2 of 5 (HERRING_RESTART=2): rank 3 exited with code 1, in "
        "2 runs in a row: leaving its process out and continuing on 3 processes "
        "(--min-processes 2; ranks renumbered from 0)"), lines
    assert lines[3].endswith("continuing on 2 processes (--min-processes 2; ranks "
                             "renumbered from 0)"), lines


def test_the_min_processes_floor_holds(tmp_path):
    # Rank 0 fails every time: left out once (3 -> 2), then restarted on 2
    # processes until the budget is spent.
    p = _run(["-n", "3", "--max-restarts", "3", "--min-processes", "2", "--",
              sys.executable, "-c", _child(tmp_path, "lambda run, rank, n: 1 if rank == 0 "
                                           "else None")])
    assert p.returncode == 1, p.stderr
    assert [len(v) for _, v in sorted(_runs(tmp_path).items())] == [3, 3, 2, 2], p.stderr


def test_min_processes_needs_max_restarts_and_fewer_than_n():
    for args in (["--min-processes", "2"], ["--max-restarts", "2", "--min-processes", "3"]):
        p = _run(["-n", "3", *args, "--", sys.executable, "-c", "pass"])
        assert p.returncode == 2, p.stderr
        assert (f"--min-processes {args[-1]} needs --max-restarts K > 0 and fewer processes "
                "than -n 3") in p.stderr, p.stderr


def test_a_stop_signal_to_the_launcher_is_never_restarted(tmp_path):
    ready = tmp_path / "ready"
    code = (f"import os, time; open({str(ready)!r} + os.environ['HERRING_PROCESS_ID'], 'w')"
            f".close(); time.sleep(60)")
    env = {**os.environ, "HERRING_LAUNCH_GRACE_S": "2"}
    proc = subprocess.Popen(_launcher(["-n", "2", "--max-restarts", "3", "--",
                                       sys.executable, "-c", code]),
                            env=env, cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        end = time.monotonic() + 60
        while not all(Path(f"{ready}{r}").exists() for r in range(2)):
            assert time.monotonic() < end and proc.poll() is None, "the ranks never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "restart" not in err, err


def test_a_process_that_does_not_stop_within_the_preemption_grace_exits_1_saying_so():
    # It never reaches a preemption_requested() call after the signal.
    code = ("import os, signal, time, herring_jax\n"
            "herring_jax.catch_preemption(grace_s=1)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.2)\n"
            "print('still running after SIGTERM', flush=True)\n"
            "time.sleep(60)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=TESTS)
    assert p.returncode == 1, p.stderr
    assert p.stdout == "still running after SIGTERM\n", p.stdout
    assert "herring_jax rank 0: got SIGTERM; every process saves at the next step boundary " \
        "and exits (within 1 s, HERRING_PREEMPTION_GRACE_S)" in p.stderr, p.stderr
    assert "herring_jax rank 0: the preemption grace of 1 s (HERRING_PREEMPTION_GRACE_S) ran " \
        "out before every process reached a preemption_requested() call; exiting with " \
        "status 1" in p.stderr, p.stderr


# --- train_lm under real kills and SIGTERM (extended tier) ---------------------------------

_DIGEST = re.compile(r"params sha256 ([0-9a-f]{16})")
_RESUMED = re.compile(r"\] resumed from the checkpoint after step (\d+)")
_LOSSES = re.compile(r"^\[rank 0\] step +\d+  loss (\S+)", re.M)
# sharded_optimizer's state is what the left-out test reshards and what the
# SIGTERM test saves and resumes. The kill test runs allreduce_gradients
# with two kills: a restart of a run that was itself
# restarted (its checkpoints written by a resumed run), and the last restart
# --max-restarts allows. Its [sharded] case (one kill) took the same restart
# path as the SIGTERM test's resume, 120 s of the extended part; the left-out
# test runs the sharded state, resharded 4 -> 3, which allreduce_gradients'
# left-out case covered less of in another 100-125 s.
_SHARDED = ["--sharded-optimizer"]
_KILLS = 2
# Runs without kills: allreduce_gradients' (--sharded-optimizer's chain is
# bitwise the same: herring's sums and the sharded optimizer's are the same,
# in float32 at this XLA level; the left-out test below relies on it too) and
# the fully sharded example's (its checkpoints are herring_jax.save_sharded's,
# each process its chunks).
_RUNS = {"allreduce": [], "fully": ["--fully-sharded"]}


def _lm_env():
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": BITWISE_COMPILE,
            "HERRING_TIMEOUT_S": "60", "HERRING_LAUNCH_GRACE_S": "5"}


def _lm(ckpt: Path, n: int = 4, launch=(), extra=(), command=None, timeout=600, env=None):
    cmd = _launcher(["-n", str(n), "--timeout", str(timeout), *launch, "--",
                     *(command or [sys.executable, "train_lm.py"]), *LM_ARGS,
                     "--checkpoint-dir", str(ckpt), *extra])
    return subprocess.run(cmd, cwd=EXAMPLES, env={**_lm_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout + 60)


def _out(proc) -> str:
    return f"exit code {proc.returncode}\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"


def _digest(proc) -> str:
    found = _DIGEST.findall(proc.stdout)
    assert len(found) == 1, _out(proc)
    return found[0]


def _once(name: str, tmp_path_factory, compute) -> str:
    """compute()'s string, computed once per test session: also across
    pytest-xdist's workers (.ci/run runs the extended tier with -n 2), which
    share their base directory's parent. Each reference below costs one or
    two launches of train_lm on 4 processes, and several tests compare with it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    done = root / f"reference-{name}"
    with open(root / f"reference-{name}.lock", "w") as lock:
        # A worker that finds the other computing it waits (it would only
        # compete for the same cores); one whose computing failed left nothing.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            value = compute()
            done.with_suffix(".tmp").write_text(value)
            done.with_suffix(".tmp").rename(done)
        return done.read_text()


def _uninterrupted(mode: str, tmp_path_factory) -> str:
    """The params sha256 of an uninterrupted run of `mode` on 4 processes."""
    def run() -> str:
        proc = _lm(tmp_path_factory.mktemp(f"whole-{mode}"), extra=_RUNS[mode])
        assert proc.returncode == 0, _out(proc)
        return _digest(proc)
    return _once(f"whole-{mode}", tmp_path_factory, run)


@pytest.mark.timeout(1500)
def test_kills_under_max_restarts_end_with_the_uninterrupted_parameters(
        tmp_path, tmp_path_factory):
    seed = random.randrange(1 << 16)
    rng = random.Random(seed)
    # One kill per run, each later than the last (_KILLS), and as many
    # restarts allowed as kills: the last kill spends the last restart.
    steps = sorted(rng.sample(range(1, 15), _KILLS))
    kills = [(s, rng.randrange(4)) for s in steps]
    plan = ",".join(f"{s}:{r}" for s, r in kills)
    proc = _lm(tmp_path / "ckpt", launch=["--max-restarts", str(len(kills))],
               extra=["--kill-at-step", plan])
    why = f"(--kill-at-step {plan}, seed {seed})\n{_out(proc)}"
    assert proc.returncode == 0, why
    restarts = [line for line in proc.stderr.splitlines() if ": restart " in line]
    assert restarts == [
        f"herring-jax launch: restart {k + 1} of {len(kills)} (HERRING_RESTART={k + 1}): "
        f"rank {r} exited "
        f"with code 137 (killed by SIGKILL); starting all 4 processes again"
        for k, (_, r) in enumerate(kills)], why
    # Each restart resumed from the last checkpoint before its kill: at most
    # --checkpoint-every (4) steps of work lost per failure.
    resumed = [int(s) for s in _RESUMED.findall(proc.stdout)]
    assert resumed == [(s + 1) // 4 * 4 for s, _ in kills if s >= 3], why
    assert _digest(proc) == _uninterrupted("allreduce", tmp_path_factory), why


def _fewer_by_hand(tmp_path_factory) -> str:
    """The params sha256 of allreduce_gradients' chain run by hand: 4
    processes to the checkpoint after step 4, then 3 resuming from it."""
    def run() -> str:
        ref = tmp_path_factory.mktemp("by-hand")
        first = _lm(ref, extra=["--steps", "4"])
        assert first.returncode == 0, _out(first)
        second = _lm(ref, n=3)
        assert second.returncode == 0, _out(second)
        return _digest(second)
    return _once("by-hand", tmp_path_factory, run)


@pytest.mark.timeout(1500)
def test_a_process_failing_after_its_first_restart_is_left_out_and_the_job_finishes(
        tmp_path, tmp_path_factory):
    # The first run's rank 3 is SIGKILLed after step 6 (a checkpoint after
    # step 4), then fails at start in every later run, as a broken host would.
    wrapper = ("import os, sys\n"
               "if os.environ['HERRING_RESTART'] != '0' and os.environ['HERRING_PROCESS_ID'] "
               "== '3':\n    sys.exit('rank 3: this host is broken')\n"
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n")
    command = [sys.executable, "-c", wrapper, "train_lm.py"]
    proc = _lm(tmp_path / "ckpt", launch=["--max-restarts", "3", "--min-processes", "2"],
               extra=[*_SHARDED, "--kill-at-step", "6"], command=command)
    assert proc.returncode == 0, _out(proc)
    restarts = [line for line in proc.stderr.splitlines() if ": restart " in line]
    assert len(restarts) == 2 and restarts[1].endswith(
        "rank 3 exited with code 1, in 2 runs in a row: leaving its process out and continuing "
        "on 3 processes (--min-processes 2; ranks renumbered from 0)"), _out(proc)
    assert [int(s) for s in _RESUMED.findall(proc.stdout)] == [4], _out(proc)
    assert "done: reduce=herring processes=3 " in proc.stdout, _out(proc)
    assert ("the checkpoint after step 4 holds --sharded-optimizer's state of 4 devices: "
            "cut into chunks of 3") in proc.stdout, _out(proc)
    # Bitwise the unsharded chain resumed the same way: the sharded state, cut
    # from 4 devices' chunks into 3's, continues exactly (herring's sums and
    # the sharded optimizer's are the same, in float32 at this XLA level).
    assert _digest(proc) == _fewer_by_hand(tmp_path_factory)


def _rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the launcher's child that runs `rank`."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"HERRING_PROCESS_ID={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no child of the launcher runs rank {rank}: {children}")


@pytest.mark.timeout(1500)
def test_sigterm_to_one_rank_saves_every_rank_at_one_step_and_resumes_bitwise(
        tmp_path, tmp_path_factory):
    ckpt = tmp_path / "ckpt"
    cmd = _launcher(["-n", "4", "--timeout", "600", "--", sys.executable, "train_lm.py",
                     *LM_ARGS, *_SHARDED, "--checkpoint-dir", str(ckpt)])
    env = {**_lm_env(), "HERRING_PREEMPTION_GRACE_S": "20"}
    proc = subprocess.Popen(cmd, cwd=EXAMPLES, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.match(r"\[rank 0\] step\s+5\s", line):
                break
        os.kill(_rank_pid(proc.pid, 2), signal.SIGTERM)
        rest, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    out = "".join(lines) + rest
    why = f"exit code {proc.returncode}\n{out[-5000:]}\n{err[-5000:]}"
    # Every rank saved and exited 75 (the grace's watchdog, 20 s, would have
    # exited 1), and so did the launcher: preempted, neither done nor failed.
    assert proc.returncode == 75, why
    assert "the ranks saved for a preemption and exited with 75" in err, why
    assert "rank 2] herring_jax rank 2: got SIGTERM" in err, why
    saved = {int(r): int(s) for r, s in re.findall(
        r"\[rank (\d)\] process \1: preempted, saved the checkpoint after step (\d+)", out)}
    assert sorted(saved) == [0, 1, 2, 3] and len(set(saved.values())) == 1, why
    step = saved[0]
    assert 6 <= step < 16 and "done:" not in out, why
    assert max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == step, why
    resumed = _lm(ckpt, extra=_SHARDED)
    assert resumed.returncode == 0, _out(resumed)
    assert [int(s) for s in _RESUMED.findall(resumed.stdout)] == [step], _out(resumed)
    # sharded_optimizer's chain is bitwise allreduce_gradients' (_RUNS): its
    # state, saved at the preemption and restored, continued exactly.
    assert _digest(resumed) == _uninterrupted("allreduce", tmp_path_factory)


@pytest.mark.timeout(900)
def test_fully_sharded_resumes_bitwise_and_onto_fewer_processes(tmp_path, tmp_path_factory):
    # 8 steps of 16 on 4 processes (checkpoints after 4 and 8), then the rest
    # on 4 processes (bitwise the uninterrupted run) and on 2 (restore_sharded
    # reads the 4 processes' chunks into 2's).
    ckpt, fewer = tmp_path / "ckpt", tmp_path / "fewer"
    first = _lm(ckpt, extra=["--fully-sharded", "--steps", "8"])
    assert first.returncode == 0, _out(first)
    assert sorted(int(p.name) for p in ckpt.iterdir()) == [4, 8], _out(first)
    shutil.copytree(ckpt, fewer)
    resumed = _lm(ckpt, extra=["--fully-sharded"])
    assert resumed.returncode == 0, _out(resumed)
    assert [int(s) for s in _RESUMED.findall(resumed.stdout)] == [8], _out(resumed)
    assert _digest(resumed) == _uninterrupted("fully", tmp_path_factory)
    # The two latest are kept.
    assert sorted(int(p.name) for p in ckpt.iterdir()) == [12, 16], _out(resumed)
    two = _lm(fewer, n=2, extra=["--fully-sharded"])
    assert two.returncode == 0, _out(two)
    assert [int(s) for s in _RESUMED.findall(two.stdout)] == [8], _out(two)
    assert "done: reduce=herring processes=2" in two.stdout, _out(two)
    # It goes on from the saved state: its first loss is the 4-process run's
    # at step 9, not a fresh model's (about 6.4 on this model).
    first_loss = float(re.search(r"\(first ([0-9.]+)\)", two.stdout).group(1))
    assert first_loss < 5.5, _out(two)


@pytest.mark.timeout(900)
def test_streaming_diloco_resumes_from_a_checkpoint_with_a_fragment_in_flight(
        tmp_path, tmp_path_factory):
    # Fragment 0 starts at step 4 and arrives at 5 (fragment 1: 6 and 7):
    # the checkpoint after step 4 holds it in flight. Rank 1 is killed after
    # step 5, the restart resumes from that checkpoint and re-issues it.
    streaming = ["--local-steps", "4", "--fragments", "2", "--delay", "1", "--steps", "10"]
    whole = _lm(tmp_path_factory.mktemp("whole-streaming"), n=2, extra=streaming)
    assert whole.returncode == 0, _out(whole)
    # The last step (10) has fragment 1 (sent after step 10) in flight: named, not dropped silently.
    assert ("note: a fragment's reduction was in flight after step 10 (--delay 1): it is not "
            "in these final parameters") in whole.stdout, _out(whole)
    proc = _lm(tmp_path / "ckpt", n=2, launch=["--max-restarts", "1"],
               extra=[*streaming, "--kill-at-step", "5:1"])
    assert proc.returncode == 0, _out(proc)
    assert [int(s) for s in _RESUMED.findall(proc.stdout)] == [4], _out(proc)
    assert _digest(proc) == _digest(whole), _out(proc)


@pytest.mark.timeout(900)
def test_local_sgd_resumes_on_fewer_processes(tmp_path):
    # 3 workers save after step 5 (one step past a sync), then 2 resume:
    # workers 0 and 1 go on from their own rows (rank 0's parameters are
    # bitwise those it saved) and sync among themselves at step 8.
    ckpt = tmp_path / "ckpt"
    local = ["--local-steps", "4", "--checkpoint-every", "5"]
    first = _lm(ckpt, n=3, extra=[*local, "--steps", "5"])
    assert first.returncode == 0, _out(first)
    same = _lm(ckpt, n=2, extra=[*local, "--steps", "5"])
    assert same.returncode == 0, _out(same)
    assert "holds --local-steps' state of 3 workers: workers 0..1 go on" in same.stdout, \
        _out(same)
    assert "done: nothing to train, the checkpoint is at step 5" in same.stdout, _out(same)
    assert _digest(same) == _digest(first), (_out(first), _out(same))
    on = _lm(ckpt, n=2, extra=[*local, "--steps", "9"])
    assert on.returncode == 0, _out(on)
    assert [int(s) for s in _RESUMED.findall(on.stdout)] == [5], _out(on)
    assert "done: reduce=herring processes=2 " in on.stdout, _out(on)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["--sharded-optimizer", "--fully-sharded"])
def test_sharded_training_through_a_server_ends_bitwise_as_without_it(tmp_path, mode):
    # sharded_optimizer's and fully_sharded's reduce-scatters and all-gathers
    # put a third of each block on the server (2 workers, 1 server), as do
    # the job's all-reduces their share (every size: HERRING_SERVER_MIN_BYTES
    # 0). The trained parameters are bitwise those of the same job without it.
    env = {"HERRING_HOST_STAGE": "0", "HERRING_SERVER_MIN_BYTES": "0"}
    without = _lm(tmp_path / "without", n=2, extra=[mode], env=env)
    assert without.returncode == 0, _out(without)
    served = _lm(tmp_path / "served", n=2, launch=["--servers", "1"], extra=[mode], env=env)
    assert served.returncode == 0, _out(served)
    [line] = re.findall(r"^\[rank 2\] HERRING_RESULT (.*)$", served.stdout, re.M)
    server = json.loads(line)
    # Each of the 16 steps reduce-scatters the gradients and all-gathers the
    # parameters (P float32 each), a third of them through the server: at
    # least 16 x 2 x P x 4 / 3 bytes summed or passed on, where the loss's
    # all-reduces alone would be a few hundred.
    [params] = re.findall(r"^\[rank 0\] ([0-9.]+) M parameters", served.stdout, re.M)
    assert server["ok"] and server["served_bytes"] >= 16 * 2 * float(params) * 1e6 * 4 / 3 * 0.9, (
        server, params)
    losses = [_LOSSES.findall(p.stdout) for p in (served, without)]
    assert len(losses[0]) == 16 and losses[0] == losses[1], _out(served)
    assert "done: reduce=herring processes=2 " in served.stdout, _out(served)
    assert _digest(served) == _digest(without), _out(served)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("network", ["local", "netns"])
def test_a_killed_server_under_max_restarts_resumes_to_the_uninterrupted_parameters(
        tmp_path, network):
    # 2 workers and a server-only process on this one host, on the flat path
    # (the host stage would sum everything through memory), with every
    # all-reduce through the server. It is killed once it has summed half of
    # what it sums in an uninterrupted run: mid-run, whatever the timing.
    # netns: each on a simulated host of its own, where the restart's ports
    # follow the first run's in the same namespaces.
    env = {"HERRING_HOST_STAGE": "0", "HERRING_SERVER_MIN_BYTES": "0"}
    net = ["--netns"] if network == "netns" else []
    whole = _lm(tmp_path / "whole", n=2, launch=[*net, "--servers", "1"], env=env)
    assert whole.returncode == 0, _out(whole)
    [line] = re.findall(r"^\[rank 2\] HERRING_RESULT (.*)$", whole.stdout, re.M)
    server = json.loads(line)
    assert server["ok"] and server["served_chunks"] > 0, server
    proc = _lm(tmp_path / "ckpt", n=2, launch=[*net, "--servers", "1", "--max-restarts", "1"],
               env={**env, "HERRING_TEST_SERVER_KILL_AT_CHUNK": str(server["served_chunks"] // 2)})
    assert proc.returncode == 0, _out(proc)
    restarts = [line for line in proc.stderr.splitlines() if ": restart " in line]
    assert restarts == [
        "herring-jax launch: restart 1 of 1 (HERRING_RESTART=1): server rank 2 exited with code "
        "137 (killed by SIGKILL); starting all 2 processes again, and the servers"], _out(proc)
    # The restart resumed from a checkpoint (one after step 4 at least: the
    # kill came about step 8 of 16), and ended bitwise where the
    # uninterrupted run did.
    resumed = [int(s) for s in _RESUMED.findall(proc.stdout)]
    assert len(resumed) == 1 and resumed[0] >= 4, _out(proc)
    assert _digest(proc) == _digest(whole), _out(proc)
