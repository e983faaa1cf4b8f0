"""What a user meets in the second hour of using herring_jax
(tests/workers/second_hour_worker.py): errors that name the transformation
they called and the leaf at fault, the sharded optimizer's check of its
inner transformation on one process as on several, the failing rank's error
first on every other rank, and stall lines that name both call sites."""

import re
from pathlib import Path

import pytest

from multiproc import assert_all_ok, launch

WORKER = "second_hour_worker.py"


def test_gradient_transformations_name_themselves_and_the_leaf():
    # An integer gradient leaf: before, "the array has integer dtype int32"
    # from inside the fusion buffers, with no leaf and no function named. A
    # misspelt axis: before, "herring_jax.pmean: unbound axis name(s)".
    run = launch(WORKER, ["transforms"], nproc=2, devices=1, timeout=240)
    assert_all_ok(run, expected_cases=8)


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_inner_transformation_is_checked_on_one_process_as_on_several(nproc):
    # sharded_optimizer(optax.lamb) initialised on one process without a
    # word, and failed only once the script ran on two.
    run = launch(WORKER, ["lamb"], nproc=nproc, timeout=240)
    assert_all_ok(run, expected_cases=1)


# A line of jax's own (absl) logging that is information or a warning, e.g.
# "W1127 12:44:10.036523   18782 preemption_sync_manager.cc:147] ...": not an error.
_LOG_LINE = re.compile(r"^[IW]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+:\d+\] ")


def first_error_line(run, rank: int) -> str | None:
    """The first line of `rank`'s stderr that is not blank and not an absl
    INFO or WARNING line: whatever a user reads first as its error (a
    traceback's first line, jax's 'F... client.h:80] Terminating process', or
    herring's own line)."""
    prefix = f"[rank {rank}] "
    for line in run.stderr.splitlines():
        if not line.startswith(prefix):
            continue
        text = line[len(prefix):]
        if text.strip() and not _LOG_LINE.match(text):
            return text
    return None


@pytest.mark.parametrize("nproc, failing, where, others", [
    (2, 0, "init", "sleep"),   # the case: rank 0, jax's coordinator, at init
    (3, 0, "user", "reduce"),  # the others wait in a reduction
    (3, 1, "user", "sleep"),   # not the coordinator: nothing of jax's ends the others
])
def test_every_survivors_first_error_line_names_the_failed_rank_and_its_exception(
        nproc, failing, where, others):
    # Before, a rank waiting in no reduction said nothing until jax.distributed
    # ended it ("F... client.h:80] Terminating process because the JAX
    # distributed service detected fatal errors") once rank 0 had exited, or
    # until the launcher's SIGTERM; one waiting in a reduction began with a
    # traceback.
    run = launch(WORKER, ["fail", "--rank", str(failing), "--where", where, "--others", others],
                 nproc=nproc, timeout=120)
    assert run.returncode != 0, run.explain()
    exception = ("ValueError: herring_jax.sharded_optimizer: the inner transformation does not "
                 "treat its parameters element by element" if where == "init"
                 else "KeyError: \"a bug in the user's own code\"")
    assert exception in run.stderr, run.explain()  # the failing rank's own traceback
    for rank in set(range(nproc)) - {failing}:
        first = first_error_line(run, rank)
        assert first is not None, f"rank {rank} printed no error\n{run.explain()}"
        assert f"herring_jax rank {rank}: rank {failing} failed: {exception}" in first, (
            f"rank {rank}'s first error line: {first!r}\n{run.explain()}")


def _marked_lines(marker: str) -> int:
    path = Path(__file__).resolve().parent / "workers" / WORKER
    [number] = [i for i, line in enumerate(path.read_text().splitlines(), 1) if marker in line]
    return number


@pytest.mark.parametrize("stage, collective", [("1", "allreduce"), ("0", "allreduce"),
                                               ("1", "reduce_scatter")])
def test_the_first_stall_line_of_each_rank_names_both_call_sites(stage, collective):
    # Rank 0 reduces float32[8] at one line, rank 1 float32[12] at another,
    # 1.5 s later. Before, rank 0's first (and only) stall line gave rank 1's
    # shape but not its line: rank 1's call site came in its own stall notice,
    # sent once it had waited HERRING_STALL_S itself. (A reduce-scatter's
    # description names the collective, which a heartbeat's does not.)
    run = launch(WORKER, ["stall", "--collective", collective], nproc=2, timeout=120,
                 env={"HERRING_STALL_S": "3", "HERRING_TIMEOUT_S": "12",
                      "HERRING_HOST_STAGE": stage})
    assert run.returncode != 0, run.explain()
    sites = [f"{WORKER}:{_marked_lines(f'# stall: rank {r}' + chr(39) + 's call')}"
             for r in (0, 1)]
    for rank in (0, 1):
        stalls = [line for line in run.stderr.splitlines()
                  if line.startswith(f"[rank {rank}] ") and "made no progress for" in line]
        assert stalls, f"rank {rank} reported no stall\n{run.explain()}"
        assert all(site in stalls[0] for site in sites), (
            f"rank {rank}'s first stall line lacks {sites}: {stalls[0]}")


def test_a_rerun_with_jax_persistent_compilation_cache_does_not_stall(tmp_path):
    # jax writes its cache from process 0 only: on the rerun, process 0 loaded
    # its step from it and the others compiled theirs, under other run ids,
    # and the first step stalled until HERRING_TIMEOUT_S.
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
           "HERRING_TIMEOUT_S": "20", "HERRING_STALL_S": "5"}
    runs = [launch(WORKER, ["steps"], nproc=2, env=env, timeout=120) for _ in range(2)]
    digests = [assert_all_ok(run, expected_cases=1)["steps"] for run in runs]
    assert len(digests[0]) == 1 and digests[0] == digests[1], digests
    # Said once, by rank 0, each time.
    for run in runs:
        said = [line for line in run.stderr.splitlines()
                if "jax's persistent compilation cache" in line]
        assert len(said) == 1 and said[0].startswith("[rank 0] "), run.explain()


def test_a_users_directory_named_herring_jax_holds_the_users_code():
    # Call sites and uncaught errors skip the frames of the installed
    # libraries, found by where they are installed: a clone of this
    # repository (a directory called herring_jax) holds the user's code, whose
    # lines the stall and mismatch messages must name, and so do the examples
    # shipped inside the installed package.
    import os
    import jaxlib
    import optax
    import herring_jax
    from herring_jax._src.process import install_dirs, jax_compat
    assert not install_dirs.in_library("/home/me/herring_jax/train.py")
    assert not install_dirs.in_library("/tmp/x/herring_jax/tests/workers/first_hour_worker.py")
    shipped = os.path.join(os.path.dirname(herring_jax.__file__), "examples", "train.py")
    assert not install_dirs.in_library(shipped)
    for module in (jax_compat, optax, jaxlib, herring_jax):
        assert install_dirs.in_library(module.__file__), module
