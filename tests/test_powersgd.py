"""herring_jax.powersgd: rank-r gradient averaging on 2 processes, step by
step against a numpy model (tests/workers/powersgd_worker.py): the same
update on every rank, matrices as rank-r approximations with warm start and
error feedback, small leaves averaged exactly, the exact warm-up, more power
iterations, and factors that cross the transport in bf16. Each configuration
also checks the codec of every reduction in the update's jaxpr."""

import pytest

from multiproc import assert_all_ok, launch


def test_powersgd_matches_the_numpy_model_on_every_rank():
    # Without warm-up, with one exact step first, with two power iterations.
    run = launch("powersgd_worker.py",
                 ["--steps", "3", "--configs", "warmup0,warmup1,iterations2"], nproc=2)
    digests = assert_all_ok(run, expected_cases=13)
    # Every rank holds the same update at every step.
    assert all(len(d) == 1 for c, d in digests.items() if "-step" in c), digests


def test_powersgd_factors_in_bf16_over_the_transport():
    # HERRING_HOST_STAGE=0: a codec applies where data crosses the transport.
    run = launch("powersgd_worker.py", ["--steps", "3", "--configs", "bf16,bf16-iterations2"],
                 nproc=2, env={"HERRING_HOST_STAGE": "0"})
    digests = assert_all_ok(run, expected_cases=9)
    assert all(len(d) == 1 for c, d in digests.items() if "-step" in c), digests


def test_powersgd_rejects_rank_zero():
    import herring_jax
    with pytest.raises(ValueError, match="rank must be at least 1"):
        herring_jax.powersgd(rank=0)
    with pytest.raises(ValueError, match="warmup_steps must be 0 or more"):
        herring_jax.powersgd(rank=4, warmup_steps=-1)
    with pytest.raises(ValueError, match="power_iterations must be at least 1"):
        herring_jax.powersgd(rank=4, power_iterations=0)
    with pytest.raises(ValueError, match="unknown codec 'fp8'"):
        herring_jax.powersgd(rank=4, codec="fp8")
