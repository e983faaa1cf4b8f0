"""herring_jax.broadcast (bitwise the root's, in and outside jit) and the
averaging of non-gradient state (BatchNorm statistics) on several processes."""

import pytest

from multiproc import assert_all_ok, launch


@pytest.mark.parametrize("nproc,devices", [(2, 2), (3, 1)])
def test_broadcast_and_batchnorm_state(nproc, devices):
    run = launch("state_worker.py", [], nproc=nproc, devices=devices)
    digests = assert_all_ok(run, expected_cases=9)
    # Parameters and statistics are the same bits on every rank.
    assert len(digests["batchnorm/params"]) == 1, digests
    assert len(digests["batchnorm/stats"]) == 1, digests
