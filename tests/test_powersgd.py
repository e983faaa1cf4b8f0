"""herring_jax.powersgd: rank-r gradient averaging on 2 processes, step by
step against a numpy model (tests/workers/powersgd_worker.py): the same
update on every rank, matrices as rank-r approximations with warm start and
error feedback, small leaves averaged exactly."""

import pytest

from multiproc import assert_all_ok, launch


def test_powersgd_matches_the_numpy_model_on_every_rank():
    run = launch("powersgd_worker.py", ["--steps", "3"], nproc=2)
    digests = assert_all_ok(run, expected_cases=4)
    # Every rank holds the same update at every step.
    assert all(len(d) == 1 for c, d in digests.items() if c.startswith("step")), digests


def test_powersgd_rejects_rank_zero():
    import herring_jax
    with pytest.raises(ValueError, match="rank must be at least 1"):
        herring_jax.powersgd(rank=0)
