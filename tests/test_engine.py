"""The engine under conditions a healthy run rarely shows, on real processes:
messages from strangers matched by posted receives, a provider whose queues
are full, and heartbeats in an idle job. Results stay bitwise exact."""

import pytest

from multiproc import assert_all_ok, launch

CASES = ["--dtypes", "float32,int32", "--ops", "sum", "--counts", "1,4097", "--mib", "4"]


def _stats(run, case="stats"):
    return {rank: next(r for r in rs if r["case"] == case) for rank, rs in run.results.items()}


@pytest.mark.parametrize("host_stage", ["0", "1"])
def test_stale_messages_are_dropped_and_the_sums_stay_exact(host_stage):
    # Before each contribution and result (and, through the host stage, each
    # of its messages), every rank sends a copy with another job's token and
    # the same tag: it matches the receive posted for the real message, which
    # drops it and posts again (DropAndRepost). The re-post task once outlived
    # a batch that the success path freed while it ran.
    run = launch("reduce_worker.py", CASES + ["--stats"], nproc=4,
                 env={"HERRING_TEST_STALE_COPIES": "1", "HERRING_HOST_STAGE": host_stage,
                      # The host stage's steps as messages, so that they are copied too.
                      "HERRING_HOST_BOARD": "0",
                      "HERRING_CHUNK_BYTES": str(256 * 1024)})
    digests = assert_all_ok(run, expected_cases=2 * 3 + 1)
    assert all(len(d) == 1 for case, d in digests.items() if case != "stats"), digests
    for rank, r in _stats(run).items():
        stats = r["stats"]
        # 4 MiB in 256 KiB chunks over 4 ranks: dozens of stale messages each.
        assert stats["messages_dropped"] >= 10, (rank, stats)
        assert stats["failed_batches_kept"] == 0, (rank, stats)
        assert stats["duplicate_completions"] == 0, (rank, stats)
        assert (stats["host_stage_calls"] > 0) == (host_stage == "1"), (rank, stats)


@pytest.mark.parametrize("hosts", [None, 2])
def test_strangers_before_the_contribution_leaves_cannot_change_an_in_place_sum(hosts):
    # Reduced in place (allreduce_gradients' buckets: the input buffer is the
    # output), a result receive is posted before this process has sent its
    # contribution from the same bytes. Every rank sends each peer full-size
    # results with another job's token and garbage bytes at the start of each
    # reduction, and waits 20 ms before sending its contributions: the
    # strangers match the posted result receives first. Received into the
    # output, their bytes would overwrite the contribution before it left (a
    # wrong sum on every rank, no error); they must be dropped unseen. In
    # 256 KiB chunks, on one host over the transport (no host stage), and on
    # 2 simulated hosts x 2 processes, where the host stage's cross-host step
    # reduces each slice in place in its staging buffer.
    run = launch("reduce_worker.py",
                 ["--in-place", "--dtypes", "float32,float64", "--ops", "mean",
                  "--counts", "1,4097", "--mib", "2", "--stats"],
                 nproc=4, hosts=hosts,
                 env={"HERRING_TEST_EARLY_STRANGERS": "1",
                      "HERRING_HOST_STAGE": "0" if hosts is None else "1",
                      "HERRING_CHUNK_BYTES": str(256 * 1024)})
    digests = assert_all_ok(run, expected_cases=2 * 3 + 1)
    assert all(len(d) == 1 for case, d in digests.items() if case != "stats"), digests
    for rank, r in _stats(run).items():
        stats = r["stats"]
        # At least one stranger per peer on the data path and reduction: 3
        # peers on one host; 1 (the other host's process of the same local
        # index) across 2 hosts.
        peers = 3 if hosts is None else 1
        assert stats["messages_dropped"] >= peers * 6, (rank, stats)
        assert stats["failed_batches_kept"] == 0, (rank, stats)


def test_posts_beyond_the_providers_queues_wait_in_herrings_queue():
    # Two operations of each direction in the provider at once: every other
    # post of a 16 MiB reduction in 64 KiB chunks waits in the transport's
    # queue, which the progress thread drains in order. The data must cross
    # the transport: no host stage.
    run = launch("reduce_worker.py",
                 ["--dtypes", "float32,bfloat16", "--ops", "sum,mean", "--counts", "4097",
                  "--mib", "16", "--stats"],
                 nproc=4, env={"HERRING_MAX_POSTED": "2", "HERRING_HOST_STAGE": "0",
                               "HERRING_CHUNK_BYTES": str(64 * 1024)})
    digests = assert_all_ok(run, expected_cases=2 * 2 * 2 + 1)
    assert all(len(d) == 1 for case, d in digests.items() if case != "stats"), digests
    for rank, r in _stats(run).items():
        assert r["stats"]["posts_queued"] > 100, (rank, r["stats"])


def test_idle_ranks_send_heartbeats_at_a_quarter_of_the_peer_limit():
    # Heartbeats every 0.2 s, peer limit 8 s: an idle rank sends each peer one
    # every 2 s (at least), not every 0.2 s. 6 idle seconds: at most 4 per
    # peer (about 3), where the full rate would be 30.
    idle_s, nproc = 6.0, 4
    run = launch("reduce_worker.py",
                 ["--dtypes", "float32", "--ops", "sum", "--counts", "7",
                  "--idle-s", str(idle_s)],
                 nproc=nproc, env={"HERRING_HEARTBEAT_S": "0.2", "HERRING_PEER_TIMEOUT_S": "8"})
    assert_all_ok(run, expected_cases=2)
    for rank, r in _stats(run, "idle").items():
        sent = r["heartbeats_sent"]
        assert 1 <= sent <= 4 * (nproc - 1), (rank, sent)


@pytest.mark.parametrize("slice_us", [None, "0", "250"])
def test_the_progress_thread_asks_for_a_short_time_slice(slice_us):
    # HERRING_PROGRESS_SLICE_US (default 100): the transport's progress thread,
    # and only it, runs with that slice; 0 leaves every thread at the
    # kernel's default. This machine's kernel (6.12+) shows each thread's
    # slice in /proc/<pid>/task/<tid>/sched.
    env = {"HERRING_HOST_STAGE": "0"}
    if slice_us is not None:
        env["HERRING_PROGRESS_SLICE_US"] = slice_us
    run = launch("slice_worker.py", [], nproc=2, env=env, timeout=120)
    assert_all_ok(run, expected_cases=1)
    want = {None: 100_000, "0": None, "250": 250_000}[slice_us]
    for rank, results in run.results.items():
        found = results[0]["slices"]
        assert len(found) > 5, f"rank {rank}: no se.slice lines in /proc (kernel < 6.6?)"
        default = max(set(found), key=found.count)  # most threads keep it
        short = [s for s in found if s != default]
        if want is None:
            assert short == [], f"rank {rank}: slices {sorted(found)}"
        else:
            assert short == [want], f"rank {rank}: slices {sorted(found)}, want one {want}"


def test_messages_forged_to_come_from_another_rank_are_never_taken_for_its_own():
    # Rank 2 knows the job token (every process does: it comes from the
    # coordinator in plain text) and sends, at the start of its first
    # reduction, an abort to rank 0 and a host-stage arrive to rank 0, both
    # claiming (tag and header) to come from rank 1, whose own arrive comes
    # 1 s late. Once, rank 0 took the abort for rank 1's failure, and the
    # arrive (rank 2's input addresses) for rank 1's inputs. Receives from a
    # peer are now posted for that peer's address (FI_DIRECTED_RECV), and a
    # control message's source address must be its claimed sender's: the
    # forged arrive never matches, the forged abort is dropped, and every sum
    # is exact.
    run = launch("fault_worker.py",
                 ["reduce", "--env", "2:HERRING_TEST_FORGE_AS=1",
                  "--env", "1:HERRING_TEST_ACTIVATE_DELAY_MS=1000"],
                 nproc=3, env={"HERRING_HOST_BOARD": "0", "HERRING_TIMEOUT_S": "60"})
    assert run.returncode == 0, run.explain()
    for rank, results in run.results.items():
        [got] = [r for r in results if r["case"] == "reduce"]
        assert not got["raised"] and got["exact"], (rank, got, run.explain())
        [stats] = [r for r in results if r["case"] == "stats"]
        assert "directed receives, sources checked" in stats["describe"], stats
    [stats0] = [r["stats"] for r in run.results[0] if r["case"] == "stats"]
    assert stats0["messages_dropped"] >= 1, stats0
    assert "claims to come from rank 1 came from rank 2's address" in run.stdout + run.stderr, \
        run.explain()


@pytest.mark.parametrize("hosts, rank0_min_chunk, messages",
                         [(2, "16384", 4), (2, "1048576", 1), (None, "16384", 1)])
def test_parts_cross_hosts_in_chunks_of_a_quarter_cut_alike_on_every_process(
        hosts, rank0_min_chunk, messages):
    # A 1 MiB float32 all-reduce on 2 processes over the transport: 512 KiB
    # parts. Between 2 simulated hosts, with 16 KiB chunks at least, each part
    # travels in 4 chunks of 128 KiB (its results flow while its last
    # contributions arrive); with 1 MiB at least, in one, the geometry before
    # small parts were cut. On one host, in one whatever the smallest chunk.
    # Rank 1 asks for the other geometry: rank 0's must hold on both, or the
    # chunks' headers would not match (a failed or hung reduction).
    other = "1048576" if rank0_min_chunk == "16384" else "16384"
    run = launch("reduce_worker.py",
                 ["--dtypes", "float32", "--ops", "sum", "--counts", "", "--mib", "1",
                  "--stats", "--describe", "--rank-env", f"1:HERRING_MIN_CHUNK_BYTES={other}"],
                 nproc=2, hosts=hosts,
                 env={"HERRING_HOST_STAGE": "0", "HERRING_HEARTBEAT_S": "0",
                      "HERRING_MIN_CHUNK_BYTES": rank0_min_chunk})
    digests = assert_all_ok(run, expected_cases=3)
    assert all(len(d) == 1 for case, d in digests.items() if case not in ("stats", "describe"))
    for rank, r in _stats(run).items():
        # Per process: its contribution to the other's part and its own
        # part's result, each in `messages` chunks, and no heartbeats. Of
        # control messages in a healthy run, only the receipt of a peer's
        # kLeave when that peer finished first, and a where-I-wait notice when
        # the other process started a second late, as it may on a loaded
        # machine. The data messages have a counter of their own: a snapshot
        # taken while a receipt is being sent could count it in
        # messages_sent before leave_notices_sent (CI, 2026-11-29).
        s = r["stats"]
        assert s["data_messages_sent"] == 2 * messages, (rank, s)
        assert s["messages_sent"] >= s["data_messages_sent"], (rank, s)
        assert s["heartbeats_sent"] == 0, (rank, s)
        assert s["wait_notices_sent"] <= 1, (rank, s)
        assert s["leave_notices_sent"] <= 1, (rank, s)
    described = _stats(run, "describe")[1]["describe"].split("; host ")[0]
    if rank0_min_chunk == "16384":
        assert described.endswith("parts in chunks of 1 MiB, across hosts of 1/4 of the part "
                                  "down to 16 KiB"), described
    else:
        assert described.endswith("parts in chunks of 1 MiB"), described
