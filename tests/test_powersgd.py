"""herring_jax.powersgd: rank-r gradient averaging on 2 processes, step by
step against a numpy model (tests/workers/powersgd_worker.py): the same
update on every rank, matrices as rank-r approximations with warm start and
error feedback, small leaves averaged exactly, and the exact warm-up."""

import pytest

from multiproc import assert_all_ok, launch


def test_powersgd_matches_the_numpy_model_on_every_rank():
    # Once without warm-up, once with one exact step first.
    run = launch("powersgd_worker.py", ["--steps", "3", "--warmups", "0,1"], nproc=2)
    digests = assert_all_ok(run, expected_cases=7)
    # Every rank holds the same update at every step.
    assert all(len(d) == 1 for c, d in digests.items() if "-step" in c), digests


def test_powersgd_rejects_rank_zero():
    import herring_jax
    with pytest.raises(ValueError, match="rank must be at least 1"):
        herring_jax.powersgd(rank=0)
    with pytest.raises(ValueError, match="warmup_steps must be 0 or more"):
        herring_jax.powersgd(rank=4, warmup_steps=-1)
