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
    # The error names the peer's run only once a heartbeat has said what the
    # peer waits in: 10 s leaves a starved process on a loaded machine time
    # for a few of them (with 5 s, a 4-rank run under load once failed these
    # checks; its message was not kept, so this is the likely cause, not a
    # proven one).
    run = launch("identity_worker.py", ["extra-launch"], nproc=nproc,
                 env={"HERRING_TIMEOUT_S": "10"}, timeout=120)
    assert run.returncode == 0, run.explain()
    assert sorted(run.results) == list(range(nproc)), run.explain()
    for rank, [result] in run.results.items():
        assert result["ok"], (rank, result)
        # Within the timeout (10 s) plus the slack of a loaded machine.
        assert result["seconds"] < 30, (rank, result)
        # Rank 1's launch counter is one ahead: its run id is one more.
        runs = sorted(int(r) for r in result["runs"])
        assert any(b - a == 1 for a, b in zip(runs, runs[1:])), (rank, result)
        assert re.search(r"rank \d+ is alive and has waited|rank \d+ failed", result["message"])


@pytest.mark.parametrize("nproc,devices", [(2, 1), (2, 2)])
def test_launch_identity_matches_ranks_whose_executables_differ(nproc, devices):
    """XLA:CUDA compiles one program into differently tuned executables per
    process (their run ids differ); the launch identity, its default there,
    still pairs every reduction. Here on XLA:CPU a rank-dependent constant
    gives each rank its own executable; the identity tests' own cases run
    under the launch identity too."""
    env = {"HERRING_TIMEOUT_S": "60", "HERRING_IDENTITY": "launch"}
    run = launch("identity_worker.py", ["different-programs"], nproc=nproc, devices=devices,
                 env=env)
    assert_all_ok(run, expected_cases=1)
    run = launch("identity_worker.py", ["match"], nproc=nproc, devices=devices, env=env)
    assert_all_ok(run, expected_cases=4 + (devices > 1))


def test_program_identity_fails_ranks_whose_executables_differ():
    """The counterpart: under the program identity (XLA:CPU's default) the
    same ranks never meet, and every rank says why within the timeout and
    names the knob."""
    run = launch("identity_worker.py", ["different-programs"], nproc=2,
                 env={"HERRING_TIMEOUT_S": "5", "HERRING_STALL_S": "2",
                      "HERRING_IDENTITY": "program"}, timeout=120)
    assert run.returncode == 0, run.explain()
    assert sorted(run.results) == [0, 1], run.explain()
    for rank, [result] in run.results.items():
        assert not result["ok"] and result["error"], (rank, result)
        assert result["seconds"] < 30, (rank, result)
        assert "this same call under another run id" in result["message"], (rank, result)
        assert "HERRING_IDENTITY=launch" in result["message"], (rank, result)


def test_occurrence_counters_are_pruned_when_idle():
    run = launch("identity_worker.py", ["prune"], nproc=2, env={"HERRING_TIMEOUT_S": "2"})
    assert_all_ok(run, expected_cases=1)
