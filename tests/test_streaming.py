"""local_sgd with delay >= 1 across process lives (tests/workers/streaming_worker.py):
a process that exits with a fragment's reduction in flight lets its peer's
matching reduction end (shutdown waits for it); a checkpoint saved after any
step resumes bitwise, one saved with a fragment in flight too (the arrival
re-issues the reduction from the state's copy of what was sent), while a
done handed a token of an earlier process life is refused, saying why; on
XLA:CUDA the step is refused when lowered; two optimizers of equal shapes
and schedules in one process, run alone and then in turn, end alike. The same arithmetic as
tests/test_local_sgd.py (its ENV says why)."""

from multiproc import BITWISE_COMPILE, assert_all_ok, launch

ENV = {"XLA_FLAGS": BITWISE_COMPILE, "HERRING_HOST_STAGE": "0",
       "HERRING_PEER_TIMEOUT_S": "20"}


def test_exits_and_checkpoints_with_a_fragment_in_flight(tmp_path):
    args = ["--dir", str(tmp_path)]
    saved = launch("streaming_worker.py", ["--phase", "save", *args], nproc=2, env=ENV)
    assert saved.returncode == 0, saved.explain()
    [exit_case] = saved.results[0]
    assert exit_case["case"] == "exit/peer-last-reduction" and exit_case["ok"], exit_case
    assert not saved.results[1], saved.results  # rank 1 left before reporting anything
    resumed = launch("streaming_worker.py", ["--phase", "resume", *args], nproc=2, env=ENV)
    assert_all_ok(resumed, expected_cases=5)
    cases = {r["case"]: r for r in resumed.results[0]}
    assert set(cases) == {"resume/not-in-flight", "resume/in-flight", "done/stale-token-refused",
                          "cuda/not-implemented", "two-optimizers/interleaved"}
    assert "ticket 4" in cases["done/stale-token-refused"]["error"], cases


def test_a_checkpoint_after_any_step_resumes_bitwise():
    run = launch("streaming_worker.py", ["--phase", "every-step"], nproc=2,
                 env=ENV)
    assert_all_ok(run, expected_cases=2)
    for r in run.results[0]:
        assert r["in_flight"] and not r["wrong"], r
