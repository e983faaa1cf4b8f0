"""Reductions are matched by identity (run: XLA's run id, or the launch
identity's instruction and launch count; slot, instance, occurrence, buffer),
never by start order: inlined copies of one call site, executables
in flight at once, train/eval alternation and loops give exact sums on every
rank; a disagreement fails every rank, the first naming both sides; the occurrence
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
def test_extra_launch_on_one_rank_fails_every_rank_and_the_first_names_both_runs(nproc):
    run = launch("identity_worker.py", ["extra-launch"], nproc=nproc,
                 env={"HERRING_TIMEOUT_S": "10"}, timeout=120)
    assert run.returncode == 0, run.explain()
    assert sorted(run.results) == list(range(nproc)), run.explain()
    named_both = []
    for rank, [result] in run.results.items():
        assert result["ok"], (rank, result)  # it raised HerringError
        # Within the timeout (10 s) plus the slack of a loaded machine.
        assert result["seconds"] < 30, (rank, result)
        # Rank 1's launch counter is one ahead: its run id is one more.
        runs = sorted(int(r) for r in result["runs"])
        if any(b - a == 1 for a, b in zip(runs, runs[1:])):
            named_both.append(rank)
            assert re.search(r"rank \d+ is alive and has waited|rank \d+ failed",
                             result["message"]), (rank, result)
        else:
            # The ranks that fail first exit (as a failed job's processes
            # do); one that fails after that may name the exit instead
            # (measured under load with 4 ranks: "rank 0 of this host exited
            # before it posted its inputs ... that have exited: rank 0, rank 3").
            assert re.search(r"rank \d+ (of this host )?exited|have exited", result["message"]), \
                (rank, result)
    # Whoever failed first saw both sides.
    assert named_both, run.explain()


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


def test_launch_counts_and_what_breaks_them():
    """The launch identity's count of one instruction, in one process: runs
    count from the first (wrapping in 32 bits) on each device; an earlier
    launch after a later one, or devices whose first launches differ, fail
    that call and every later one (never a count one off)."""
    from herring_jax import _herring_ffi as ext

    assert ext.count_launches_for_test([(7, 0), (8, 0), (7, 1), (10, 1), (9, 0)]) == \
        ["0", "1", "0", "3", "2"]
    wrap = 2**31 - 1  # XLA's launch ids are int32: the next one is -2**31
    assert ext.count_launches_for_test([(wrap, 0), (-2**31, 0)]) == ["0", "1"]
    late = ext.count_launches_for_test([(8, 0), (7, 0), (9, 0)])
    assert late[0] == "0" and all(x.startswith("error: ") for x in late[1:]), late
    assert "run 7 after run 8" in late[1] and "HERRING_IDENTITY=program" in late[1], late
    split = ext.count_launches_for_test([(7, 0), (8, 1), (8, 0)])
    assert split[0] == "0" and all(x.startswith("error: ") for x in split[1:]), split
    assert "device 1" in split[1] and "device 0" in split[1], split


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
