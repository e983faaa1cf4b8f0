"""Failing peers and mismatched reductions give HerringError on every
surviving rank, fast, with the reason; never a hang or a wrong result."""

from multiproc import assert_all_ok, launch


def test_mismatched_shapes_fail_every_rank_at_once():
    run = launch("failure_worker.py", ["mismatch"], nproc=2, env={"HERRING_TIMEOUT_S": "120"})
    assert_all_ok(run, expected_cases=2)
    for rank, results in run.results.items():
        first = results[0]
        # Far below the 120 s timeout: the detecting rank told the other.
        assert first["seconds"] < 30, first
        assert "float32[1000]" in first["message"] and "float32[1024]" in first["message"]


def test_dead_peer_is_named_within_the_timeout():
    run = launch("failure_worker.py", ["dead-peer"], nproc=2, env={"HERRING_TIMEOUT_S": "5"})
    assert run.returncode == 0, run.explain()
    [result] = run.results[0]
    assert result["ok"], result
    assert 4 < result["seconds"] < 30, result
