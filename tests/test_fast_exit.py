"""The default fast exit after an uncaught exception (HERRING_FAST_EXIT=1,
errors.exit_now) skips the exit handlers, but not what they would have
done for the user: the timeline's last slices are written, the failed
reduction's among them, and a KeyboardInterrupt ends the process by SIGINT,
as Python's own exit does. See tests/workers/exit_worker.py."""

import json

import pytest

from multiproc import launch


def _run(case: str, tmp_path, **env):
    run = launch("exit_worker.py", [case], nproc=2, timeout=180,
                 env={"HERRING_TIMELINE": str(tmp_path / "trace.json"), **env})
    # Rank 0 outlives rank 1 (it sleeps), so rank 1's end is the job's.
    assert "exit_worker: rank" not in run.stdout, run.explain()
    return run


def _reductions(tmp_path, rank: int) -> dict[str, dict]:
    """The reductions' slices in rank's trace, by name; the file must be
    complete JSON (as Chrome's trace format), not only loadable."""
    events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())
    assert any(e.get("name") == "process_name" for e in events), events
    return {e["name"]: e for e in events if e.get("ph") == "X" and "args" in e}


def _one(slices: dict, *words: str) -> dict:
    found = [e for name, e in slices.items() if all(w in name for w in words)]
    assert len(found) == 1, (words, list(slices))
    return found[0]


@pytest.mark.parametrize("case,last,raised", [
    ("timeline-failing", "float32[2000]", "herring_jax.HerringError: "),
    ("timeline-pending", "float32[3000]", "ValueError: rank 1 gives up"),
])
def test_the_fast_exit_writes_the_failed_reductions_slice(case, last, raised, tmp_path):
    run = _run(case, tmp_path, HERRING_TIMEOUT_S="5")
    assert run.returncode == 1, run.explain()
    assert "rank 1 exited with code 1" in run.stderr, run.explain()
    assert raised in run.stderr, run.explain()
    slices = _reductions(tmp_path, 1)
    # Both written by the exit alone: the worker stretched the periodic
    # append to an hour.
    first = _one(slices, "float32[1000]")
    assert first["args"]["ok"] and not first["name"].startswith("FAILED"), first
    failed = _one(slices, last)
    assert failed["name"].startswith("FAILED ") and not failed["args"]["ok"], failed
    assert failed["ts"] >= first["ts"] + first["dur"], (first, failed)
    _reductions(tmp_path, 0)  # rank 0, stopped by the launcher: its file is still JSON


def test_a_keyboard_interrupt_ends_the_rank_by_sigint(tmp_path):
    run = _run("sigint", tmp_path)
    # Python's status for an uncaught KeyboardInterrupt (death by SIGINT),
    # which the launcher reports as such and passes on; not 1.
    assert "rank 1 exited with code 130 (killed by SIGINT)" in run.stderr, run.explain()
    assert run.returncode == 130, run.explain()
    assert "KeyboardInterrupt" in run.stderr, run.explain()
    # The trace is written there too.
    assert _one(_reductions(tmp_path, 1), "float32[1000]")["args"]["ok"]


def test_a_fast_exit_first_tells_the_others_a_failure_that_a_server_thread_owes(tmp_path):
    # Rank 1's failure is told from its server threads, which run 2 s late
    # here (a saturated host); its uncaught HerringError ends it at once.
    # The exit waits for the others' acknowledgment first, as a clean exit
    # does: rank 0 prints rank 1's reason (before it acknowledges), where it
    # heard nothing before.
    run = _run("owed-abort", tmp_path, HERRING_HOST_STAGE="0")
    assert run.returncode == 1, run.explain()
    assert "rank 1 exited with code 1" in run.stderr, run.explain()
    assert ("herring_jax rank 0: rank 1 failed: rank 1: test fault abort-at-start"
            in run.stderr), run.explain()


def test_a_rank_whose_process_0_is_gone_still_exits_at_once(monkeypatch):
    # At a fast exit every rank stores "ending" in jax's key-value store for
    # process 0 (herring_jax/_src/process/last_words.py). Where process 0 is gone,
    # that request could wait out gRPC's timeout: the exit waits 1 s at most.
    import threading
    import time

    from herring_jax._src.process import jax_compat
    from herring_jax._src.process import last_words

    release = threading.Event()

    class Unanswered:
        def key_value_set(self, key, value):
            release.wait(30)

    monkeypatch.setattr(jax_compat, "distributed_client", Unanswered)
    start = time.monotonic()
    try:
        last_words.say_ending(1, 1)
        took = time.monotonic() - start
    finally:
        release.set()
    assert 0.9 < took < 5, took
