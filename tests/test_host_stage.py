"""The host stage: processes of one host reduce through memory
(xla_ffi/engine/host_stage.cc) and only each host's share crosses the network.

Every dtype and op, bitwise against the numpy reference of the documented order
(the processes of a host in rank order, then the hosts), on 2 simulated hosts
x 2 processes (network namespaces; 1 host x 2 and x 4 processes are
tests/test_allreduce.py), and over the transport alone; the path taken is
checked from the counters, not assumed. The steps (where the inputs and the
result slices are) go through shared-memory boards, or through transport
messages with HERRING_HOST_BOARD=0; both are run. A host whose processes
cannot read each other's memory falls back to the transport for all of them.
Killed processes on a host are covered by tests/test_chaos.py, which runs 4
processes on one host."""

import os

import pytest

from multiproc import assert_all_ok, fault_run, launch

DTYPES = ["float32", "float64", "bfloat16", "float16", "int32", "int64"]
COUNTS = "1,7,4097,100003"
# 4 MiB: slices of 1 MiB, 4 pieces of the reduce-scatter each. Short mode
# under .ci/sanitizers.sh: 1 MiB is the largest size.
MIB = "1" if os.environ.get("HERRING_SANITIZER") else "1,4"


def _cases() -> int:
    sizes = len(COUNTS.split(",")) + len(MIB.split(","))
    return sum(1 if d.startswith("int") else 2 for d in DTYPES) * sizes


def _extra(run, name: str) -> list[dict]:
    """Each rank's report of `name` (describe, stats)."""
    found = [r for rs in run.results.values() for r in rs if r["case"] == name]
    assert len(found) == run.nproc, run.explain()
    return found


def _run(nproc, hosts=None, devices=1, env=None, extra=()):
    run = launch("reduce_worker.py",
                 ["--devices", str(devices), "--counts", COUNTS, "--mib", MIB, "--describe",
                  "--stats", *extra],
                 nproc=nproc, devices=devices, hosts=hosts, env=env)
    digests = assert_all_ok(run, expected_cases=_cases() + 2)
    assert all(len(d) == 1 for d in digests.values()), digests
    return run


STEPS = {"1": "steps on shared-memory boards",
         "0": "steps as messages (HERRING_HOST_BOARD=0)"}


@pytest.mark.parametrize("hosts,devices,board", [(2, 1, "1"), (2, 2, "1"), (2, 1, "0")])
def test_every_dtype_through_the_host_stage(hosts, devices, board):
    run = _run(4, hosts=hosts, devices=devices, env={"HERRING_HOST_BOARD": board})
    per_host = 4 // hosts
    for d in _extra(run, "describe"):
        assert f"{per_host} processes on it, host stage through memory, {STEPS[board]}" \
            in d["describe"], d
    for s in _extra(run, "stats"):
        stats = s["stats"]
        # Every reduction of every case took the host stage and read its
        # peers' memory (a count-1 buffer reads nothing on 3 of 4 ranks).
        assert stats["host_stage_calls"] == stats["reductions"] > 0, stats
        assert stats["host_bytes_read"] > 0, stats


def test_host_stage_off_reduces_over_the_transport():
    # Every dtype and op over the transport alone, in rank order.
    run = _run(4, env={"HERRING_HOST_STAGE": "0"})
    for d in _extra(run, "describe"):
        assert "host stage off: HERRING_HOST_STAGE=0" in d["describe"], d
    for s in _extra(run, "stats"):
        assert s["stats"]["host_stage_calls"] == 0 and s["stats"]["host_bytes_read"] == 0, s


def test_a_process_whose_memory_cannot_be_read_turns_its_host_to_the_transport():
    # Flat: the reference sums in plain rank order ("1x4").
    run = _run(4, hosts=2, env={"HERRING_TEST_HOSTS": "1x4"}, extra=("--deny-reads-rank", "3"))
    described = {r: [x for x in rs if x["case"] == "describe"][0]["describe"]
                 for r, rs in run.results.items()}
    # Ranks 2 and 3 share host 1: both fall back; host 0 keeps its stage, but
    # a group spans both hosts, so every reduction of this job is flat.
    for rank in (2, 3):
        assert "host stage off: rank 3 refuses memory reads" in described[rank], described
    for rank in (0, 1):
        assert "host stage through memory" in described[rank], described
    for s in _extra(run, "stats"):
        assert s["stats"]["host_stage_calls"] == 0, s
    assert "reduce over the transport, not through memory" in run.stderr, run.explain()


def test_on_one_host_the_boards_carry_every_step_and_messages_only_heartbeats():
    # 1 host x 4: with the boards no transport message but heartbeats leaves
    # any process; with messages each reduction sends 3 per peer.
    sent = {}
    for board in ("1", "0"):
        run = launch("reduce_worker.py",
                     ["--dtypes", "float32", "--ops", "sum", "--counts", "4097", "--mib", "1",
                      "--describe", "--stats"],
                     nproc=4, env={"HERRING_HOST_BOARD": board})
        assert_all_ok(run, expected_cases=4)
        for d in _extra(run, "describe"):
            assert f"4 processes on it, host stage through memory, {STEPS[board]}" \
                in d["describe"], d
            # The direct path needs the boards; its default limit is named.
            direct = ", all-reduces up to 32 KiB in one wait (direct path)"
            assert (direct in d["describe"]) == (board == "1"), d
        stats = [s["stats"] for s in _extra(run, "stats")]
        assert all(s["host_stage_calls"] == s["reductions"] > 0 for s in stats), stats
        # 4097 elements go the direct way with the boards, 1 MiB the two steps.
        assert all(s["host_direct_calls"] == (s["reductions"] // 2 if board == "1" else 0)
                   for s in stats), stats
        # Data messages only (control messages, heartbeats and the leave
        # protocol's, have counters of their own that a snapshot can split).
        sent[board] = [(s["data_messages_sent"], s["reductions"]) for s in stats]
    assert all(data == 0 for data, _ in sent["1"]), sent
    assert all(data >= 9 * reductions for data, reductions in sent["0"]), sent


def test_a_call_of_more_buffers_than_a_board_posting_holds_goes_as_messages():
    # 200 buffers in one call (a posting holds 128) next to a one-buffer call,
    # twice: the wide calls' steps go as messages, the others' on the boards,
    # and every sum is exact on every rank.
    run = launch("wide_worker.py", [], nproc=4)
    assert_all_ok(run, expected_cases=5)
    for s in _extra(run, "stats"):
        stats = s["stats"]
        assert stats["host_stage_calls"] == 4, stats
        # The 2 wide calls' 3 steps to 3 peers, nothing for the others.
        assert stats["data_messages_sent"] == 18, stats


def test_a_process_that_cannot_map_boards_turns_only_its_host_to_messages():
    # 2 hosts x 2: rank 3 cannot map its neighbour's board, so host 1's steps
    # go as messages while host 0 keeps its boards, in the same reductions.
    run = _run(4, hosts=2, extra=("--deny-boards-rank", "3"))
    described = {r: [x for x in rs if x["case"] == "describe"][0]["describe"]
                 for r, rs in run.results.items()}
    for rank in (0, 1):
        assert f"host stage through memory, {STEPS['1']}" in described[rank], described
    for rank in (2, 3):
        assert ("host stage through memory, steps as messages (rank 3 refuses boards "
                "(HERRING_TEST_DENY_BOARDS))") in described[rank], described
    for s in _extra(run, "stats"):
        assert s["stats"]["host_stage_calls"] == s["stats"]["reductions"] > 0, s


@pytest.mark.parametrize("slow_rank,board", [(0, "1"), (3, "1"), (3, "0")])
def test_a_slow_reader_gets_exact_results_while_its_peers_shut_down_and_exit(slow_rank, board):
    # The slow rank reads the others' slices of the last result about 0.8 s
    # after they returned; they shut down and leave at once (os._exit, no
    # jax.distributed barrier; rank 0, jax's coordinator, last). Shutting down
    # must wait for that read:
    # freed staging would give wrong bits, an exited owner an error.
    run = launch("reduce_worker.py",
                 ["--dtypes", "int32,float32", "--ops", "sum", "--counts", "4097",
                  "--mib", "4", "--slow-reader-rank", str(slow_rank), "--exit-after-shutdown",
                  "--stats"],
                 nproc=4, env={"HERRING_HOST_BOARD": board})
    digests = assert_all_ok(run, expected_cases=5)
    assert all(len(d) == 1 for d in digests.values()), digests
    for s in _extra(run, "stats"):
        assert s["stats"]["host_stage_calls"] == s["stats"]["reductions"] == 4, s




@pytest.mark.parametrize("board,direct", [("1", "0"), ("0", "0"), ("1", "1")])
def test_a_failed_call_withdraws_its_inputs_before_anyone_uses_a_slice_of_them(board, direct):
    # Rank 1 publishes its slice of the result, then fails without telling
    # anyone (as when another rank's abort reaches it first) and returns; its
    # inputs are then overwritten, as when XLA reuses their memory. Rank 2
    # reads rank 1's inputs only after that (it reads slowly). Once, rank 2
    # went on to publish a slice of overwritten bytes and it and rank 0
    # returned wrong sums as successes. Rank 1 must withdraw its inputs before
    # it returns (its board posting marked, or a withdrawal message it waits
    # on), and whoever read them must find that out before using the slice:
    # every rank fails, naming the withdrawal, long before the timeout.
    #
    # On the direct path (direct="1": HERRING_HOST_DIRECT_BYTES raised to the
    # buffer's 256 KiB; the others set it to 0) each process reads
    # staged copies and there is no ready step: rank 1 fails after its own
    # reads, and rank 2 finds the withdrawal after its slow reads. Rank 0 may
    # have read everything before rank 1 withdrew: the copies it read are
    # exact, so it either returns the exact sum or fails naming the withdrawal.
    run, reduces, stats = fault_run(
        ["reduce", "--env", "1:HERRING_TEST_FAULT=withdraw-after-ready",
         "--env", "2:HERRING_TEST_READ_DELAY_MS=500"], 3,
        env={"HERRING_HOST_BOARD": board,
             "HERRING_HOST_DIRECT_BYTES": "262144" if direct == "1" else "0"})
    for rank, [got] in reduces.items():
        assert got["seconds"] < 30, (rank, got)
        if direct == "1" and rank == 0 and not got["raised"]:
            assert got["exact"], (rank, got, run.explain())
            continue
        assert got["raised"], (rank, got, run.explain())
    for rank, s in stats.items():
        assert s["host_direct_calls"] == (1 if direct == "1" else 0), (rank, s)
    assert "test fault withdraw-after-ready" in reduces[1][0]["message"], reduces
    for rank in (0, 2):
        if not reduces[rank][0]["raised"]:
            continue  # rank 0 on the direct path, exact (checked above)
        # The withdrawal, or a read of the inputs that XLA has already freed
        # (EFAULT; seen under ThreadSanitizer), which fails as well.
        message = reduces[rank][0]["message"]
        assert "withdrew" in message or "cannot read rank 1's input" in message, reduces


def test_the_host_board_is_sealed_against_resizing_and_writers():
    # A process that takes another's board (pidfd_getfd, as the host's
    # processes do) can neither shrink it (its owner and readers would die of
    # SIGBUS at their next access), nor grow it, nor map it writable.
    run = launch("fault_worker.py", ["seals"], nproc=2)
    assert run.returncode == 0, run.explain()
    assert all(r["ok"] for rs in run.results.values() for r in rs), run.explain()
    [seals] = [r for r in run.results[1] if r["case"] == "seals"]
    assert seals == {"case": "seals", "ok": True, "shrink": "refused", "grow": "refused",
                     "map_writable": "refused"}, seals
    for rank, results in run.results.items():
        [got] = [r for r in results if r["case"] == "reduce"]
        assert not got["raised"] and got["exact"], (rank, got)


def _ptrace_run(extra_env_args=()):
    run = launch("fault_worker.py", ["ptrace", *extra_env_args], nproc=3,
                 env={"HERRING_TEST_PTRACE_SCOPE": "1"})
    assert run.returncode == 0, run.explain()
    found = {}
    for rank, results in run.results.items():
        by_case = {r["case"]: r for r in results}
        assert not by_case["reduce"]["raised"] and by_case["reduce"]["exact"], by_case
        found[rank] = by_case
    assert sorted(found) == [0, 1, 2], run.explain()
    return found


def test_under_ptrace_scope_1_a_process_lets_only_its_hosts_common_ancestor_read_it():
    # Yama's scope 1 (Ubuntu's default) lets only ancestors read a process's
    # memory unless it declares a tracer. Once, every process declared any
    # process of the user (PR_SET_PTRACER_ANY) for its whole life. Now it
    # declares the nearest common ancestor of its host's processes (here the
    # launcher, their parent), which admits that process and its descendants,
    # says so in describe(), and takes it back at shutdown(). (This kernel has
    # no Yama: HERRING_TEST_PTRACE_SCOPE=1 records what would be declared.)
    found = _ptrace_run()
    parents = {r: f["ptrace"]["parent"] for r, f in found.items()}
    assert len(set(parents.values())) == 1 and 1 not in parents.values(), parents
    for rank, f in found.items():
        assert f["ptrace"]["declared"] == parents[rank], f
        assert (f"memory readable by pid {parents[rank]} and its descendants (the nearest "
                "common ancestor of this host's processes") in f["ptrace"]["describe"], f
        assert f["after-shutdown"]["declared"] is None, f


def test_a_process_that_allows_no_memory_reads_declares_nothing_and_turns_its_host_stage_off():
    found = _ptrace_run(["--env", "1:HERRING_ALLOW_MEMORY_READS=0"])
    for rank, f in found.items():
        # Nobody reads on this host, so nobody keeps a declaration either.
        assert f["ptrace"]["declared"] is None, f
        assert ("host stage off: rank 1 lets no other process read its memory "
                "(HERRING_ALLOW_MEMORY_READS=0)") in f["ptrace"]["describe"], f
        assert "memory readable" not in f["ptrace"]["describe"], f


def test_processes_with_no_common_ancestor_but_init_let_any_process_of_the_user_read(
        monkeypatch):
    # Started apart (each under init), a host's processes have no narrower
    # tracer to declare: PR_SET_PTRACER_ANY, said in what describe() shows.
    from herring_jax._src.process import topology

    assert topology.nearest_common_ancestor([[30, 20, 10, 1], [31, 21, 10, 1]]) == 10
    assert topology.nearest_common_ancestor([[30, 20, 1], [20, 1]]) == 20  # parent and child
    assert topology.nearest_common_ancestor([[30, 1], [31, 1]]) == 1
    assert topology.ancestors()[-1] == 1 and topology.ancestors()[0] == os.getpid()
    monkeypatch.setenv("HERRING_TEST_PTRACE_SCOPE", "1")
    records = [{"ancestors": [30, 1]}, {"ancestors": [31, 1]}]
    whom, why = topology._let_host_read(None, records, [0, 1], 0)
    try:
        assert why == "" and topology.declared_ptracer() == -1, (whom, why)
        assert whom.startswith("any process of this user (PR_SET_PTRACER_ANY: this host's "
                               "processes share no ancestor but init"), whom
    finally:
        topology.take_back_ptracer(None)
    assert topology.declared_ptracer() is None
