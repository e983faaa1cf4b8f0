"""local_sgd with delay >= 1 across process lives (tests/workers/streaming_worker.py):
a process that exits with a fragment's reduction in flight lets its peer's
matching reduction end (shutdown waits for it); a checkpoint saved where
nothing is in flight resumes bitwise, one saved with a fragment in flight is
refused at the step that would collect it, with the error that says why; on
XLA:CUDA the step is refused when lowered; two optimizers of equal shapes
and schedules in one process, run alone and then in turn, end alike. The same arithmetic as
tests/test_local_sgd.py (its ENV says why)."""

from multiproc import assert_all_ok, launch

ENV = {"XLA_FLAGS": "--xla_backend_optimization_level=0", "HERRING_HOST_STAGE": "0",
       "HERRING_PEER_TIMEOUT_S": "20"}


def test_exits_and_checkpoints_with_a_fragment_in_flight(tmp_path):
    args = ["--dir", str(tmp_path)]
    saved = launch("streaming_worker.py", ["--phase", "save", *args], nproc=2, env=ENV)
    assert saved.returncode == 0, saved.explain()
    [exit_case] = saved.results[0]
    assert exit_case["case"] == "exit/peer-last-reduction" and exit_case["ok"], exit_case
    assert not saved.results[1], saved.results  # rank 1 left before reporting anything
    resumed = launch("streaming_worker.py", ["--phase", "resume", *args], nproc=2, env=ENV)
    assert_all_ok(resumed, expected_cases=4)
    cases = {r["case"]: r for r in resumed.results[0]}
    assert set(cases) == {"resume/not-in-flight", "resume/in-flight-refused",
                          "cuda/not-implemented", "two-optimizers/interleaved"}
    assert "ticket 4" in cases["resume/in-flight-refused"]["error"], cases
