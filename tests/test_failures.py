"""Failing peers and mismatched reductions give HerringError on every
surviving rank, fast, with the reason; never a hang or a wrong result."""

from multiproc import assert_all_ok, launch


# Different shapes, or the same reductions in another order, are different
# executables on the two ranks: different identities (XLA run ids) that never
# match, so they fail at HERRING_TIMEOUT_S (not at once, as when reductions
# were paired by call site and round), on every rank, naming both sides: the
# waiting rank's own reduction and, from its heartbeats, the peer's.


def test_mismatched_shapes_fail_every_rank_within_the_timeout():
    run = launch("failure_worker.py", ["mismatch"], nproc=2, env={"HERRING_TIMEOUT_S": "5"})
    assert_all_ok(run, expected_cases=2)
    for rank, results in run.results.items():
        first = results[0]
        assert first["seconds"] < 30, first  # 5 s and the slack of a loaded machine
        assert "float32[1000]" in first["message"] and "float32[1024]" in first["message"]


def test_mismatched_codecs_fail_every_rank_naming_the_codec():
    run = launch("failure_worker.py", ["codec-mismatch"], nproc=2,
                 env={"HERRING_TIMEOUT_S": "5"})
    assert_all_ok(run, expected_cases=2)
    for rank, results in run.results.items():
        first = results[0]
        assert first["seconds"] < 30, first
        # Each rank's own reduction and, from its heartbeats, the peer's.
        assert "float32[1000] sum over bf16" in first["message"], first
        assert "float32[1000] sum (key" in first["message"], first


def test_different_order_fails_every_rank_naming_both_reductions():
    run = launch("failure_worker.py", ["order"], nproc=2, env={"HERRING_TIMEOUT_S": "5"})
    assert_all_ok(run, expected_cases=1)
    assert all(rs[0]["seconds"] < 30 for rs in run.results.values()), run.results


def test_peer_that_skips_a_reduction_is_reported_alive_and_idle():
    run = launch("failure_worker.py", ["absent-peer"], nproc=2,
                 env={"HERRING_TIMEOUT_S": "4", "HERRING_PEER_TIMEOUT_S": "30"})
    assert run.returncode == 0, run.explain()
    [result] = run.results[0]
    assert result["ok"], result


def test_dead_peer_is_detected_by_heartbeats_long_before_the_timeout():
    run = launch("failure_worker.py", ["dead-peer"], nproc=2,
                 env={"HERRING_TIMEOUT_S": "120", "HERRING_PEER_TIMEOUT_S": "3"})
    assert run.returncode == 0, run.explain()
    [result] = run.results[0]
    assert result["ok"], result
    assert "no heartbeat" in result["message"] and "key " in result["message"], result
    assert 2.5 < result["seconds"] < 60, result


def test_slow_but_alive_peer_is_not_declared_dead():
    # Rank 1 arrives 8 s late; its heartbeats keep rank 0 (peer timeout 2 s) waiting.
    run = launch("failure_worker.py", ["slow-peer", "8"], nproc=2,
                 env={"HERRING_TIMEOUT_S": "120", "HERRING_PEER_TIMEOUT_S": "2"})
    assert_all_ok(run, expected_cases=1)
    first = run.results[0][0]
    assert first["seconds"] > 6, first  # rank 0 really waited for rank 1
    assert first["heartbeats"] >= 3 and first["declared_dead"] == 0, first


def test_dead_peer_is_named_within_the_timeout():
    run = launch("failure_worker.py", ["dead-peer"], nproc=2, env={"HERRING_TIMEOUT_S": "5"})
    assert run.returncode == 0, run.explain()
    [result] = run.results[0]
    assert result["ok"], result
    assert 4 < result["seconds"] < 30, result


def test_failure_inside_the_users_jit_raises_herring_error():
    env = {"HERRING_TIMEOUT_S": "120", "HERRING_PEER_TIMEOUT_S": "3"}
    run = launch("failure_worker.py", ["jit-dead-peer", "caught"], nproc=2, env=env)
    assert run.returncode == 0, run.explain()
    [result] = run.results[0]
    assert result["ok"] and result["is_jax_error"], result
    assert result["seconds"] < 60, result


def test_uncaught_failure_inside_jit_prints_herring_error_and_fails_the_job():
    env = {"HERRING_TIMEOUT_S": "120", "HERRING_PEER_TIMEOUT_S": "3"}
    run = launch("failure_worker.py", ["jit-dead-peer", "uncaught"], nproc=2, env=env)
    assert run.returncode != 0, run.explain()
    assert not run.results.get(0), run.explain()  # rank 0 died before reporting
    assert "herring_jax.HerringError: " in run.stderr + run.stdout, run.explain()
    assert "rank 1 has sent nothing" in run.stderr + run.stdout, run.explain()
