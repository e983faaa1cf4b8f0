"""herring_jax.psum_scatter / all_gather / pmax / pmin against jax.lax's, and
the process-level reduce_scatter / allgather / barrier / allreduce(max, min)
against numpy, on real processes.

The lax comparison runs on 4 devices as 1 process x 4, 2 x 2 and 4 x 1 (1-D
and 2-D meshes, tuples of axes in both orders, shard_map with and without
check_vma, pmap, vmap unnamed / named / of a shard_map, jit, grad / vjp /
linear_transpose / jvp, every dtype, axis_index_groups, the errors): see
tests/workers/collectives_worker.py. The process-level cases run on those 2
and 4 processes (host stage through memory), and on their own on 3 processes
over the transport alone and on 2 simulated hosts x 2 processes: see
tests/workers/process_collectives_worker.py.
"""

import pytest

from multiproc import assert_all_ok, launch

# Per mesh configuration (5): 1 forward, 1 float reference; for the 2 full
# ones also forward without check_vma, 2 derivatives and 1 vmap. Then dtypes,
# a codec, 4 axis_index_groups, pmap, vmap-named, errors.
MESH_CASES = 5 * 2 + 2 * 4 + 1 + 1 + 4 + 1 + 1 + 1
# reduce_scatter 4 + bool/parts 1, allgather 2, derivatives 1, max-min 1,
# codec 1, barrier 1, errors 1, stats 1.
PROCESS_CASES = 4 + 1 + 2 + 1 + 1 + 1 + 1 + 1 + 1


def _host_stage_calls(run) -> list[int]:
    return [r["stats"]["host_stage_calls"] for rs in run.results.values() for r in rs
            if r["case"] == "stats"]


@pytest.mark.parametrize("nproc,devices", [(1, 4), (2, 2), (4, 1)])
def test_lax_compatibility_and_process_collectives(nproc, devices):
    run = launch("collectives_worker.py", [], nproc=nproc, devices=devices)
    assert_all_ok(run, expected_cases=MESH_CASES + (PROCESS_CASES if nproc > 1 else 0))
    if nproc > 1:  # the process-level collectives went through the host stage
        assert all(calls > 0 for calls in _host_stage_calls(run)), run.explain()


def test_process_collectives_on_three_processes_over_the_transport():
    run = launch("process_collectives_worker.py", [], nproc=3, env={"HERRING_HOST_STAGE": "0"})
    assert_all_ok(run, expected_cases=PROCESS_CASES)
    assert _host_stage_calls(run) == [0, 0, 0], run.explain()


def test_process_collectives_on_one_host_through_the_boards():
    # 3 processes of one host (parts of unequal size): the all-gathers read no
    # input in the host stage, only the peers' result slices; .ci/sanitizers.sh
    # runs this under UBSan, which caught them reading a posting at index -1.
    run = launch("process_collectives_worker.py", [], nproc=3)
    assert_all_ok(run, expected_cases=PROCESS_CASES)
    assert all(calls > 0 for calls in _host_stage_calls(run)), run.explain()


def test_process_collectives_on_two_simulated_hosts():
    # 2 network namespaces x 2 processes: the host stage, then the stage
    # across hosts; the reference sums in that order (HERRING_TEST_HOSTS).
    run = launch("process_collectives_worker.py", [], nproc=4, hosts=2)
    assert_all_ok(run, expected_cases=PROCESS_CASES)
    assert all(calls > 0 for calls in _host_stage_calls(run)), run.explain()
