"""Bad input and lifecycle: each documented behaviour is exercised in a real job."""

import pytest

from multiproc import assert_all_ok, launch

CASES = ["before-initialize", "bad-dtype", "bad-dtype-uint8", "bad-op", "int-mean",
         "bad-op-in-jit", "reinitialize-different", "reinitialize-same", "empty-tree",
         "zero-size-leaf", "non-finite", "scalar", "shutdown-twice"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_documented_errors_and_edge_cases(nproc):
    run = launch("errors_worker.py", [], nproc=nproc)
    assert_all_ok(run, expected_cases=len(CASES))
    assert [r["case"] for r in run.results[0]] == CASES
