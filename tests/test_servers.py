"""Server-only processes (herring-jax launch --servers K): workers place parts
of each all-reduce on processes that only sum, and get bitwise the sums they
get without them; a killed server fails every worker fast, naming it."""

import pytest
from multiproc import launch

from herring_jax._src.collectives import codecs
from herring_jax._src.process import knobs

# The flat path: with one process per host (a cluster) that is every group's;
# on this one machine the host stage would sum everything through memory.
FLAT = {"HERRING_HOST_STAGE": "0"}
CASES = ["--dtypes", "float32,bfloat16,int32", "--ops", "sum,mean",
         "--counts", "1,7,4097", "--mib", "1", "--stats"]


def _cases(run, rank):
    return {r["case"]: r for r in run.results[rank] if r["case"] != "stats"}


def test_two_workers_and_a_server_sum_bitwise_as_without_it():
    # Half of each buffer to the server (the split for 2 workers, 1 server),
    # then all of it: each worker checks its results against the numpy
    # rank-order sum (float32 accumulation for 16-bit inputs), which is
    # also what the same job without a server returns (below).
    without = launch("reduce_worker.py", CASES, nproc=2, env=FLAT)
    assert without.returncode == 0, without.explain()
    for share in ("", "1"):
        # Every buffer, however small, on the servers' path here.
        run = launch("reduce_worker.py", CASES, nproc=2, servers=1,
                     env={**FLAT, "HERRING_SERVER_SHARE": share,
                          "HERRING_SERVER_MIN_BYTES": "0"})
        assert run.returncode == 0, run.explain()
        for rank in (0, 1):
            got, want = _cases(run, rank), _cases(without, rank)
            assert got.keys() == want.keys() and got, (got.keys(), want.keys())
            for name, case in got.items():
                assert case["ok"], (name, case)
                assert case["digest"] == want[name]["digest"], (name, case, want[name])
            [stats] = [r for r in run.results[rank] if r["case"] == "stats"]
            assert stats["stats"]["served_jobs"] > 0, stats
        # jax saw the workers alone; the server summed parts of every buffer,
        # and never imported jax (herring_jax/_src/launcher/serving.py).
        [server] = run.results[2]
        assert server["ok"] and server["served_chunks"] >= len(_cases(run, 0)), server
        assert server["jax_imported"] is False, server


def test_the_host_stage_sums_across_hosts_through_the_servers_bitwise_as_without_them():
    # 2 simulated hosts x 2 workers: each host sums through memory, then each
    # process's slice of its host's sum crosses hosts, and with servers part
    # of each slice goes through them (the 0.6 share: both the workers' shards
    # and the 2 servers sum some of it). Every rank checks its results
    # against the numpy reference of the host stage's order (the processes of
    # a host, then the hosts), which is also what the same job without
    # servers returns (the digests, below).
    args = CASES + ["--describe"]
    without = launch("reduce_worker.py", args, nproc=4, hosts=2)
    assert without.returncode == 0, without.explain()
    run = launch("reduce_worker.py", args, nproc=4, hosts=2, servers=2,
                 env={"HERRING_SERVER_SHARE": "0.6", "HERRING_SERVER_MIN_BYTES": "0"})
    assert run.returncode == 0, run.explain()
    for rank in range(4):
        got, want = _cases(run, rank), _cases(without, rank)
        assert set(got) == set(want) and len(got) > 2, (got.keys(), want.keys())
        for name, case in got.items():
            if name == "describe":
                assert "2 processes on it, host stage through memory" in case["describe"], case
                continue
            assert case["ok"], (name, case)
            assert case["digest"] == want[name]["digest"], (name, case, want[name])
        [stats] = [r for r in run.results[rank] if r["case"] == "stats"]
        stats = stats["stats"]
        # Every reduction took the host stage, and its slices went through the
        # servers (a count-1 buffer's slice is empty on a host's second process).
        assert stats["host_stage_calls"] == stats["reductions"] > 0, stats
        assert stats["served_jobs"] > 0, stats
    for server in (4, 5):
        [result] = run.results[server]
        assert result["ok"] and result["served_chunks"] > 0, result


CODECS = ["--codec", "bf16,fp16,int8", "--dtypes", "float32", "--ops", "sum,mean",
          "--counts", "1,7,4097", "--mib", "1", "--stats"]
# Parts in several chunks, so that chunks of encoded parts meet at the servers.
SMALL_CHUNKS = {"HERRING_CHUNK_BYTES": str(64 << 10)}


def test_every_codec_through_the_servers_sums_bitwise_as_without_them():
    # 2 workers with 1 server (half of each buffer on it) and with 2 (all of
    # it on them): a server decodes each worker's encoded chunk, sums in
    # float32 in rank order and sends the sum back encoded, as a worker's
    # shard does, so every rank gets the bits of the job without servers
    # (and rank 0 those of the codec's numpy model).
    env = {**FLAT, **SMALL_CHUNKS, "HERRING_SERVER_MIN_BYTES": "0"}
    without = launch("reduce_worker.py", CODECS, nproc=2, env=env)
    assert without.returncode == 0, without.explain()
    names = set(_cases(without, 0))
    assert len(names) == 24 and all(n.split(":")[0] in ("bf16", "fp16", "int8") for n in names)
    for servers in (1, 2):
        # 2 servers among 2 workers would take 2/3 by default (every flow alike).
        share = {"HERRING_SERVER_SHARE": "1"} if servers == 2 else {}
        run = launch("reduce_worker.py", CODECS, nproc=2, servers=servers, env={**env, **share})
        assert run.returncode == 0, run.explain()
        for rank in (0, 1):
            got, want = _cases(run, rank), _cases(without, rank)
            assert got.keys() == want.keys() == names, (got.keys(), want.keys())
            for name, case in got.items():
                assert case["ok"], (servers, name, case)
                assert case["digest"] == want[name]["digest"], (servers, name, case, want[name])
            [stats] = [r for r in run.results[rank] if r["case"] == "stats"]
            assert stats["stats"]["served_jobs"] == len(names), stats
        served = [run.results[rank][0] for rank in range(2, 2 + servers)]
        assert all(s["ok"] and s["served_chunks"] > 0 for s in served), served
        if servers == 2:
            # With the share 1 every element went
            # through the servers, and as encoded (every part and chunk
            # begins at a codec block, so their encodings add up to the
            # buffer's): a quarter to a half of the float32 bytes.
            encoded = sum(codecs.wire_bytes(n.split(":")[0], int(n.rsplit("/", 1)[1]))
                          for n in names)
            assert sum(s["served_bytes"] for s in served) == encoded, (served, encoded)
            raw = sum(4 * int(n.rsplit("/", 1)[1]) for n in names)
            assert encoded < 0.6 * raw, (encoded, raw)


def test_the_host_stage_sends_encoded_slices_through_the_servers_bitwise_as_without_them():
    # 2 simulated hosts x 2 workers, 2 servers taking 0.6 of each slice:
    # each host sums through memory in float32, each process's slice of that
    # sum crosses hosts encoded, partly through the servers. Rank 0 checks
    # against the codec's numpy model of the host stage's order; every rank
    # matches the job without servers.
    args = ["--codec", "int8,fp16", "--dtypes", "float32", "--ops", "sum,mean",
            "--counts", "7,4097", "--mib", "1", "--stats"]
    env = {"HERRING_SERVER_MIN_BYTES": "0"}
    without = launch("reduce_worker.py", args, nproc=4, hosts=2, env=env)
    assert without.returncode == 0, without.explain()
    run = launch("reduce_worker.py", args, nproc=4, hosts=2, servers=2,
                 env={**env, "HERRING_SERVER_SHARE": "0.6"})
    assert run.returncode == 0, run.explain()
    for rank in range(4):
        got, want = _cases(run, rank), _cases(without, rank)
        assert got.keys() == want.keys() and len(got) == 12, (got.keys(), want.keys())
        for name, case in got.items():
            assert case["ok"], (name, case)
            assert case["digest"] == want[name]["digest"], (name, case, want[name])
        [stats] = [r for r in run.results[rank] if r["case"] == "stats"]
        stats = stats["stats"]
        assert stats["host_stage_calls"] == stats["reductions"] > 0, stats
        # A count-7 buffer's slice is empty on a host's second process.
        assert stats["served_jobs"] >= 8, stats
    for server in (4, 5):
        [result] = run.results[server]
        assert result["ok"] and result["served_chunks"] > 0, result


def _halves_match(run, without, ranks, expected):
    """Every case of served_halves_worker.py ok, with the digests of the job
    without servers, and each buffer through the servers."""
    for rank in ranks:
        got, want = _cases(run, rank), _cases(without, rank)
        assert got.keys() == want.keys() and len(got) == expected, (got.keys(), want.keys())
        for name, case in got.items():
            assert case["ok"], (name, case)
            assert case["digest"] == want[name]["digest"], (name, case, want[name])
            assert case["served"] == 1 and want[name]["served"] == 0, (name, case)


def test_reduce_scatter_and_allgather_through_the_servers_are_bitwise_as_without_them():
    # 3 workers, 2 servers: each block (a worker's part) goes 2/5 through the
    # servers, which sum a reduce-scatter's share and send it to the block's
    # owner alone, and pass an all-gather's share on from its owner to the
    # others. Small chunks: several per part. Every case is checked against
    # numpy in rank order (the worker) and against the job without servers.
    env = {**FLAT, **SMALL_CHUNKS, "HERRING_SERVER_MIN_BYTES": "0"}
    without = launch("served_halves_worker.py", [], nproc=3, env=env)
    assert without.returncode == 0, without.explain()
    run = launch("served_halves_worker.py", [], nproc=3, servers=2, env=env)
    assert run.returncode == 0, run.explain()
    # 3 counts x (float32 and bfloat16: 2 ops, int32: 1; and an all-gather each).
    _halves_match(run, without, range(3), 3 * (2 + 2 + 1 + 3))
    for server in (3, 4):
        [result] = run.results[server]
        assert result["ok"] and result["served_chunks"] > 0, result


def test_the_host_stage_sends_encoded_blocks_through_the_servers_bitwise_as_without_them():
    # 2 simulated hosts x 2 workers, 2 servers: each host sums through memory,
    # and each process's slice of a reduce-scatter or all-gather crosses hosts
    # block by block, half of each through the servers, encoded: the servers
    # decode, sum in float32 and encode a reduce-scatter's share (as a
    # worker does), and pass an all-gather's on as it came.
    args = ["--codecs", "bf16,fp16,int8", "--counts", "8192,66560"]  # parts of whole blocks
    without = launch("served_halves_worker.py", args, nproc=4, hosts=2, env=SMALL_CHUNKS)
    assert without.returncode == 0, without.explain()
    run = launch("served_halves_worker.py", args, nproc=4, hosts=2, servers=2,
                 env={**SMALL_CHUNKS, "HERRING_SERVER_MIN_BYTES": "0"})
    assert run.returncode == 0, run.explain()
    _halves_match(run, without, range(4), 3 * 2 * 3)


def test_codec_chunks_of_one_block_above_server_chunk_bytes_reach_the_server():
    # HERRING_CHUNK_BYTES of 512: a codec's chunk is still one block of 256
    # elements (fp16: 516 bytes on the wire), more than the chunk size that
    # a server's receives would otherwise hold. Every element through the
    # server (share 1), checked against the codec's numpy model.
    run = launch("reduce_worker.py", ["--codec", "fp16,bf16,int8", "--dtypes", "float32",
                                      "--ops", "sum", "--counts", "1000"],
                 nproc=2, servers=1,
                 env={**FLAT, "HERRING_CHUNK_BYTES": "512", "HERRING_SERVER_SHARE": "1",
                      "HERRING_SERVER_MIN_BYTES": "0", "HERRING_TIMEOUT_S": "20"})
    assert run.returncode == 0, run.explain()
    for rank in (0, 1):
        cases = _cases(run, rank)
        assert len(cases) == 3 and all(c["ok"] for c in cases.values()), cases
    [server] = run.results[2]
    assert server["ok"] and server["messages_dropped"] == 0, server
    assert server["served_bytes"] == sum(codecs.wire_bytes(c, 1000)
                                         for c in ("fp16", "bf16", "int8")), server


def test_error_feedback_through_the_servers_keeps_what_each_contribution_lost():
    # allreduce_gradients(compression="int8") on 2 workers with a server
    # that sums half of each buffer: every step's update is the codec
    # model's mean of the contributions (gradient plus residual), and every
    # residual exactly what this rank's encoding lost, whoever summed
    # (tests/workers/ef_worker.py checks both on every rank).
    run = launch("ef_worker.py", ["--codec", "int8"], nproc=2, servers=1,
                 env={**FLAT, "HERRING_SERVER_MIN_BYTES": "0"})
    assert run.returncode == 0, run.explain()
    for rank in (0, 1):
        cases = run.results[rank]
        assert len(cases) == 4 and all(c["ok"] for c in cases), cases
    [server] = run.results[2]
    # It summed encoded chunks: over the 3 steps, less than the int8 buffers
    # (and the bfloat16 leaf's) whole, where its float32 share alone (2696 of
    # the 5000 elements) would be twice that.
    bound = 3 * (codecs.wire_bytes("int8", 5000) + 2 * 10)
    assert server["ok"] and 0 < server["served_bytes"] <= bound < 3 * 4 * 2696, (server, bound)


def test_error_feedback_in_the_host_stage_through_the_servers_keeps_each_slice_loss():
    # 2 simulated hosts x 2 workers, 2 servers taking 0.6 of each slice:
    # each process keeps exactly what its slice of its host's float32 sum
    # lost on its way (to a worker's shard or to a server), zeros elsewhere;
    # every step's update and residual against the numpy model
    # (tests/workers/ef_host_worker.py).
    run = launch("ef_host_worker.py", ["--codec", "int8", "--transform", "allreduce"],
                 nproc=4, hosts=2, servers=2,
                 env={"HERRING_SERVER_SHARE": "0.6", "HERRING_SERVER_MIN_BYTES": "0"})
    assert run.returncode == 0, run.explain()
    for rank in range(4):
        cases = run.results[rank]
        assert len(cases) == 4 and all(c["ok"] for c in cases), cases
    # Each host's 2 slices of 2048 elements put 1280 on the servers (0.6,
    # cut at a codec block: 768 and 512), which summed them int8-encoded in
    # each of the 3 steps.
    for server, elems in ((4, 768), (5, 512)):
        [result] = run.results[server]
        assert result["ok"], result
        assert result["served_bytes"] == 3 * 2 * codecs.wire_bytes("int8", elems), result


def test_workers_that_ask_for_different_codecs_fail_naming_both_through_a_server():
    # Rank 0 compresses float32[1000] with bf16, rank 1 does not, and the
    # server would take half of it: two programs, whose messages never match
    # (their keys differ), so neither the workers' shards nor the server sum
    # anything; each worker fails within HERRING_TIMEOUT_S with a HerringError
    # that names both reductions, codec included, and the server as waiting
    # in none (it never mistakes one for the other).
    run = launch("failure_worker.py", ["codec-mismatch"], nproc=2, servers=1,
                 env={**FLAT, "HERRING_TIMEOUT_S": "5", "HERRING_SERVER_MIN_BYTES": "0"})
    for rank in (0, 1):
        [first, *_] = run.results[rank]
        assert first["ok"] and first["seconds"] < 30, (first, run.explain())
        assert "float32[1000] sum over bf16" in first["message"], first
        assert "float32[1000] sum (key" in first["message"], first
        assert "rank 2 is alive and waits in no reduction" in first["message"], first


def test_only_buffers_of_at_least_server_min_bytes_use_the_servers():
    # Default knobs: a 28-byte all-reduce stays on the workers' shards, one
    # of twice HERRING_SERVER_MIN_BYTES goes through the server; both sum
    # right (checked against numpy on rank 0, digests alike on rank 1).
    big_mib = 2 * knobs.KNOBS["HERRING_SERVER_MIN_BYTES"].default / 2**20
    run = launch("reduce_worker.py", ["--dtypes", "float32", "--ops", "sum", "--counts", "7",
                                      "--mib", str(big_mib), "--stats"],
                 nproc=2, servers=1, env=FLAT)
    assert run.returncode == 0, run.explain()
    for rank in (0, 1):
        cases = _cases(run, rank)
        assert len(cases) == 2 and all(c["ok"] for c in cases.values()), cases
        [stats] = [r for r in run.results[rank] if r["case"] == "stats"]
        assert stats["stats"]["served_jobs"] == 1, stats
    [server] = run.results[2]
    assert server["ok"] and server["served_chunks"] >= 1, server


def test_allreduce_gradients_default_buffers_go_through_the_servers():
    # 10 MiB of gradients: without servers the default buffers (a sixteenth,
    # 640 KiB) would all stay below HERRING_SERVER_MIN_BYTES and the server
    # would carry nothing; with servers the default is a quarter, at least
    # that threshold (optax_transform.AUTO_SERVED_BUCKETS).
    # Leaves of 2 MiB, the first buffer at most 1 MiB: 2 MiB, then 4 + 4
    # through the server. With int8 the default stays a sixteenth (a codec
    # encodes each buffer's chunks, so other buffers would change the bits):
    # one buffer per leaf.
    run = launch("served_gradients_worker.py", [], nproc=2, servers=1, env=FLAT)
    assert run.returncode == 0, run.explain()
    digests = set()
    for rank in (0, 1):
        exact, int8 = run.results[rank]
        assert exact["ok"] and int8["ok"], (exact, int8)
        assert (exact["buffers"], exact["served"]) == (3, 2), exact
        assert (int8["buffers"], int8["served"]) == (5, 0), int8
        digests.add(exact["digest"])
    assert len(digests) == 1, run.explain()
    [server] = run.results[2]
    assert server["ok"] and server["served_chunks"] >= 2, server


@pytest.mark.parametrize("rank0_fault", ["", "slow-server-threads"],
                         ids=["server-threads-on-time", "slow-server-threads"])
def test_a_killed_server_fails_every_worker_fast_naming_it(rank0_fault):
    # Default HERRING_PEER_TIMEOUT_S (30 s): rank 0 sees the server's
    # rendezvous connection close and fails the job, telling the others.
    # The worker ends with os._exit as soon as its reduction fails: rank 0 has
    # told rank 1 (which hears of the server from it alone) before its own
    # error comes, even where its server threads run late after the failure
    # (slow-server-threads: a saturated host; rank 1 heard nothing before).
    run = launch("servers_worker.py", [], nproc=2, servers=1,
                 env={**FLAT, "HERRING_TEST_SERVER_EXIT_S": "3", "HERRING_TIMEOUT_S": "120",
                      "HERRING_SERVER_MIN_BYTES": "0", "HERRING_TEST_RANK0_FAULT": rank0_fault})
    assert run.returncode != 0, run.explain()
    assert "server rank 2" in run.stderr, run.explain()
    for rank in (0, 1):
        assert len(run.results[rank]) == 1, (rank, run.explain())
        [result] = run.results[rank]
        assert result["ok"] and result["steps"] > 0, (result, run.explain())
        assert "server rank 2 is gone" in result["message"], result
        # Long before the peer limit (30 s) that would otherwise name it.
        assert result["seconds"] < 15, result


def test_workers_told_of_servers_that_never_come_say_how_to_start_them():
    run = launch("reduce_worker.py", ["--counts", "1"], nproc=2,
                 env={**FLAT, "HERRING_SERVERS": "1", "HERRING_INIT_TIMEOUT_S": "5"},
                 timeout=120)
    assert run.returncode != 0, run.explain()
    assert "1 server-only processes (HERRING_SERVERS)" in run.stderr, run.explain()
    assert "herring-jax serve --coordinator" in run.stderr, run.explain()
