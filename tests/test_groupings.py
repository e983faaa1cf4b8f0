"""Differently-grouped reductions over the same local devices, interleaved,
on 1 process x 4 devices and 2 processes x 2 devices (issue: two psums over
different axes of one mesh timed out, then corrupted memory)."""

import pytest

from multiproc import assert_all_ok, launch


@pytest.mark.parametrize("nproc,devices", [(1, 4), (2, 2)])
def test_interleaved_groupings_match_lax(nproc, devices):
    run = launch("groupings_worker.py", [], nproc=nproc, devices=devices,
                 env={"HERRING_TIMEOUT_S": "30"})
    assert_all_ok(run, expected_cases=3)
