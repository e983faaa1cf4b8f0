"""Overlap smoke test: the standard jitted training step starts reducing its
first gradient bucket before the backward pass has produced the last gradient,
and its reduced gradients are bitwise those of reducing outside the step. Asserts an
order of events (engine timeline, a callback in the backward pass), never a
duration. The figures (hidden fraction, timeline PNG) come from
`herring-jax train-bench --overlap`."""

import pytest

from multiproc import assert_all_ok, launch


@pytest.mark.parametrize("nproc", [2, 4])
def test_reductions_overlap_the_backward_pass(nproc):
    run = launch("overlap_smoke_worker.py", [], nproc=nproc)
    assert_all_ok(run, expected_cases=3)
