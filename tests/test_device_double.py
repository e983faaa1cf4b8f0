"""XLA:CUDA's handler code on the CPU suite: the start/done pair
(xla_ffi/device_handlers.cc) run on CPU devices against the device layer's
CPU double (xla_ffi/device_double.h: copies on a stream thread of its own,
events, a fault hook), multi-process, against numpy. What only a GPU can
check (CUDA itself, XLA:CUDA's scheduling) is the GPU check's
(docs/guides/gpus.md)."""

import pytest

from multiproc import assert_all_ok, launch

DOUBLE = {"HERRING_TEST_DEVICE_DOUBLE": "1"}


def _run(mode, nproc, faults=(), env=None, timeout=240):
    return launch("device_double_worker.py", [mode, *faults], nproc=nproc,
                  env={**DOUBLE, **(env or {})}, timeout=timeout)


@pytest.mark.parametrize("nproc,identity", [(2, "program"), (3, "launch")])
def test_cuda_handler_code_on_the_double_reduces_bitwise_like_numpy(nproc, identity):
    # 6 dtypes x 3 sizes (+ mean), three launches of one program, a helper
    # inlined twice, allreduce_gradients' buckets: each lowered to the
    # double's start and done, every byte copied out and back by the double.
    run = _run("allreduce", nproc, env={"HERRING_IDENTITY": identity})
    digests = assert_all_ok(run, expected_cases=27)
    assert all(len(d) == 1 for d in digests.values()), digests
    for results in run.results.values():
        assert all(r.get("double", True) and r.get("paired", True) for r in results), results
        [copied] = [r for r in results if r["case"] == "double-copied"]
        assert copied["copies_to_host"] == copied["copies_to_device"] == 30, copied


def test_delayed_copies_on_the_double_still_give_the_right_sums():
    # Rank 0's second start copies to the host 1.5 s late (herring's thread
    # must wait for it); rank 1's second done copies back 1.5 s late (what
    # XLA computes from the result must wait for it).
    run = _run("delayed", 2, ["0:delay:host:2:1500", "1:delay:device:2:1500"])
    assert_all_ok(run, expected_cases=4)
    for rank in (0, 1):
        [fired] = [r for r in run.results[rank] if r["case"] == "delay-fired"]
        assert fired["delayed"] == 1, fired


def test_a_peer_killed_while_its_copy_is_in_flight_fails_the_others_naming_it():
    run = _run("killed", 3, ["2:kill:host:3"], env={"HERRING_TIMEOUT_S": "60"})
    assert run.returncode != 0, run.explain()
    assert "kills this process while copy 3 to the host is in flight" in run.stderr, run.explain()
    for rank in (0, 1):
        # Step 2's copy kills rank 2: the others fail there, or in step 1
        # where they were still reading rank 2's inputs from its memory.
        [got] = run.results[rank]
        assert got["ok"] and got["step"] in (1, 2) and got["seconds"] < 60, (got, run.explain())


def test_a_failed_copy_fails_its_rank_whose_abort_fails_the_other_at_once():
    # Rank 1's second copy to the host fails; it dies of the error, telling
    # rank 0, whose own copy of that reduction is 1 s late.
    run = _run("abort", 2, ["1:fail:host:2", "0:delay:host:2:1000"],
               env={"HERRING_TIMEOUT_S": "60"})
    assert run.returncode != 0, run.explain()
    [own] = run.results[1]
    assert own["ok"] and own["step"] == 1, (own, run.explain())
    # The error sticks: it reaches the start (recording its event) or herring's
    # thread (waiting for it), whichever comes after the failed copy.
    assert "copy 2 to the host failed (the CPU double's fault hook" in own["message"], own
    [other] = run.results[0]
    assert other["ok"] and other["step"] == 1 and other["seconds"] < 30, (other, run.explain())


def test_a_failed_copy_back_to_the_device_fails_the_step_instead_of_returning_garbage():
    # Rank 0's first done copies the sum back and that copy fails: the
    # results hold whatever XLA's buffers held, and the step must fail.
    run = _run("fail-back", 2, ["0:fail:device:1"], env={"HERRING_TIMEOUT_S": "60"})
    assert run.returncode != 0, run.explain()
    [own] = run.results[0]
    assert own["ok"] and own["step"] == 0, (own, run.explain())
    assert "copy 1 to the device failed (the CPU double's fault hook" in own["message"], own
    [other] = run.results[1]
    assert other["ok"] and other["seconds"] < 30, (other, run.explain())


def test_a_copy_the_device_never_reaches_in_time_fails_the_done_and_the_peer():
    # Rank 0's first copy to the host takes 6 s: its done gives up at
    # HERRING_TIMEOUT_S + HERRING_CUDA_DONE_GRACE_S = 4 s; rank 1's reduction
    # times out at 2 s naming rank 0.
    run = _run("timeout", 2, ["0:delay:host:1:6000"],
               env={"HERRING_TIMEOUT_S": "2", "HERRING_CUDA_DONE_GRACE_S": "2"})
    results = {rank: rs[0] for rank, rs in run.results.items()}
    assert sorted(results) == [0, 1] and all(r["ok"] for r in results.values()), run.explain()
    assert "not ended after 4 s" in results[0]["message"], results[0]
    assert "timed out after 2 s" in results[1]["message"], results[1]


def test_the_double_fault_hook_refuses_what_it_cannot_do():
    from herring_jax import _herring_ffi
    from herring_jax._src.process import knobs

    for bad in ("delay:host:1", "fail:gpu:1", "kill:host:0", "stall:host:1", "fail:host:1:5"):
        with pytest.raises(ValueError, match="KIND:WAY:N"):
            _herring_ffi.set_device_double_faults(bad)
        with pytest.raises(ValueError, match="KIND:WAY:N"):
            knobs.KNOBS["HERRING_TEST_DEVICE_FAULT"].parse(bad)
    _herring_ffi.set_device_double_faults("delay:host:2:10,fail:device:1,kill:host:9")
    _herring_ffi.set_device_double_faults("")


def _halves(mode, nproc, faults=(), env=None):
    return launch("device_halves_worker.py", [mode, *faults], nproc=nproc,
                  env={**DOUBLE, **(env or {})}, timeout=240)


@pytest.mark.parametrize("nproc", [2, 3])
def test_reduce_scatter_and_all_gather_on_the_double_match_numpy_bitwise(nproc):
    # 6 dtypes x 3 sizes (1, 1001, 4099: uneven parts), reduce_scatter (+ mean)
    # and allgather, and the lax drop-ins in shard_map: each lowered to the
    # double's start and done, every operand copied to the host and every
    # result, at its own size, back (an all-gather's N times its operand).
    run = _halves("collectives", nproc)
    digests = assert_all_ok(run, expected_cases=3 * 13 + 2)
    assert all(len(d) == 1 for c, d in digests.items() if c.startswith("allgather")), digests
    for results in run.results.values():
        assert all(r.get("double", True) and r.get("paired", True) for r in results), results
        [copied] = [r for r in results if r["case"] == "double-copied"]
        assert copied["copies_to_host"] == copied["copies_to_device"] == 3 * 13 + 2, copied


def test_sharded_optimizer_and_fully_sharded_on_the_double_equal_the_runs_without_it():
    # adam on a small model, 2 steps, once through the double and once
    # without it: bitwise equal parameters; every byte of the first through
    # the double, none of the second. sharded_optimizer also with the int8
    # codec, whose error feedback returns each reduce-scatter's losses.
    run = _halves("sharded", 2)
    digests = assert_all_ok(run, expected_cases=3)
    assert all(len(d) == 1 for d in digests.values()), digests
    for results in run.results.values():
        for r in results:
            assert r["through"]["copies_to_host"] > 0 and r["around"]["copies_to_host"] == 0, r


@pytest.mark.parametrize("way", ["host", "device"])
def test_a_failed_copy_of_a_gather_fails_every_rank_with_a_clear_error(way):
    # Rank 1's second gather fails its copy to the host (its operand) or back
    # to the device (the gathered result, N times the operand): rank 1 raises
    # the double's error uncaught, and rank 0 fails at once naming rank 1.
    run = _halves("gather-fault", 2, [f"1:fail:{way}:2"], env={"HERRING_TIMEOUT_S": "60"})
    assert run.returncode != 0, run.explain()
    [own] = run.results[1]
    assert own["ok"] and own["step"] == 1, (own, run.explain())
    assert f"copy 2 to the {way} failed (the CPU double's fault hook" in own["message"], own
    [other] = run.results[0]
    assert other["ok"] and other["step"] in (1, 2) and other["seconds"] < 30, (other,
                                                                                run.explain())
