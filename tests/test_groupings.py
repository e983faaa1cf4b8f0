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


@pytest.mark.parametrize("nproc,devices", [(1, 130), (2, 66)])
def test_more_groups_than_wire_streams(nproc, devices):
    """65 or 66 'model' groups in one psum (the wire has 63 streams): groups
    inside one process are not limited; the 'data' groups span processes."""
    run = launch("many_groups_worker.py", [], nproc=nproc, devices=devices)
    assert_all_ok(run, expected_cases=2)
