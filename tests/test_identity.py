"""Reductions are matched by identity (XLA run id, slot, instance, occurrence,
buffer), never by start order: inlined copies of one call site, executables
in flight at once, train/eval alternation and loops give exact sums on every
rank; a disagreement fails every rank naming both sides; the occurrence
counters do not grow with the number of runs."""

import re

import pytest

from multiproc import assert_all_ok, launch


@pytest.mark.parametrize("nproc,devices", [(2, 1), (4, 1), (2, 2)])
def test_concurrent_and_inlined_reductions_are_exact(nproc, devices):
    run = launch("identity_worker.py", ["match"], nproc=nproc, devices=devices,
                 env={"HERRING_TIMEOUT_S": "60"})
    assert_all_ok(run, expected_cases=4 + (devices > 1))


@pytest.mark.parametrize("nproc", [2, 4])
def test_extra_launch_on_one_rank_fails_every_rank_naming_both(nproc):
    run = launch("identity_worker.py", ["extra-launch"], nproc=nproc,
                 env={"HERRING_TIMEOUT_S": "5"}, timeout=120)
    assert run.returncode == 0, run.explain()
    assert sorted(run.results) == list(range(nproc)), run.explain()
    for rank, [result] in run.results.items():
        assert result["ok"], (rank, result)
        # Within the timeout (5 s) plus the slack of a loaded machine.
        assert result["seconds"] < 30, (rank, result)
        # Rank 1's launch counter is one ahead: its run id is one more.
        runs = sorted(int(r) for r in result["runs"])
        assert any(b - a == 1 for a, b in zip(runs, runs[1:])), (rank, result)
        assert re.search(r"rank \d+ is alive and has waited|rank \d+ failed", result["message"])


def test_occurrence_counters_are_pruned_when_idle():
    run = launch("identity_worker.py", ["prune"], nproc=2, env={"HERRING_TIMEOUT_S": "2"})
    assert_all_ok(run, expected_cases=1)
