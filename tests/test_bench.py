"""A small run of `herring-jax bench` keeps the benchmark working (timings are
not asserted: they are only meaningful as ratios inside one run)."""

import importlib.util as importlib_util
import json
import os
import subprocess
import sys

import numpy as np
import pytest


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax.bench", "-n", "2", "--sizes-mib", "1,4",
         "--iters", "3", "--warmup", "1", "--json", str(out), "--plot", str(plot)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "herring x" in proc.stdout and "started by mpirun" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert data["n"] == 2
    # Every peer ran that .ci/install.sh installs, so none may be missing: all
    # of them on Python 3.11; on 3.12 and later all but torch_gloo, since the
    # registry has only CUDA builds of torch (several GB) for those.
    peers = ["herring", "jax_psum", "mpi4jax", "mpi4py", "torch_gloo"]
    if sys.version_info[:2] != (3, 11) and importlib_util.find_spec("torch") is None:
        peers.remove("torch_gloo")
        assert set(data["missing"]) == {"torch_gloo"}, data["missing"]
    else:
        assert data["missing"] == {}, data["missing"]
    assert sorted((r["mib"], r["peer"]) for r in data["results"]) == sorted(
        (m, p) for m in (1.0, 4.0) for p in peers)
    assert all(r["correct"] and len(r["times_s"]) == 3 for r in data["results"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # On one host the bound is memory: n * bytes at the measured copy rate.
    assert data["link_gbps"] is None and data["memory_gbps"] > 0, data
    assert data["bound_s"]["4.0"] == pytest.approx(2 * 4 * 2**20 / (data["memory_gbps"] * 1e9))
    assert "herring at 4 MiB: " in proc.stdout and "of the bound" in proc.stdout, proc.stdout
    # One host of 2 processes: the host stage's steps go through the
    # shared-memory boards, so no message per reduction (a heartbeat may fall
    # into the timed runs) and no data cross the transport.
    [herring4] = [r for r in data["results"] if r["peer"] == "herring" and r["mib"] == 4.0]
    assert herring4["messages_per_run"] < 3, herring4
    assert herring4["bytes_sent_per_run"] < 4096, herring4
    assert len(data["max_rss_mib_by_rank"]) == 2 and min(data["max_rss_mib_by_rank"]) > 50


def test_bench_codecs_checks_the_numpy_model(tmp_path):
    # Over the transport (host stage off), so that the codec applies: every
    # rank's result must be the codec's model, and int8 sends about a quarter.
    out = tmp_path / "codecs.json"
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax.bench", "-n", "2", "--sizes-mib", "1",
         "--iters", "2", "--warmup", "1", "--peers", "herring", "--codecs", "int8",
         "--collective", "allreduce,reduce_scatter,all_gather", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HERRING_HOST_STAGE": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {(r["collective"], r["peer"]): r for r in json.loads(out.read_text())["results"]}
    assert set(runs) == {(c, p) for c in ("allreduce", "reduce_scatter", "all_gather")
                         for p in ("herring", "herring_int8")}
    assert all(r["correct"] for r in runs.values()), runs
    for c in ("allreduce", "reduce_scatter", "all_gather"):
        ratio = (runs[c, "herring"]["bytes_sent_per_run"]
                 / runs[c, "herring_int8"]["bytes_sent_per_run"])
        assert 3.5 < ratio < 4.1, (c, ratio)
    # Each half sends (n-1)/n of the 1 MiB buffer, the all-reduce twice that.
    sent = {c: runs[c, "herring"]["bytes_sent_per_run"] / 2**20 for c, _ in runs}
    assert 0.5 <= sent["reduce_scatter"] < 0.52 and 0.5 <= sent["all_gather"] < 0.52, sent
    assert 1.0 <= sent["allreduce"] < 1.02, sent
    assert "herring_int8 at 1 MiB: " in proc.stdout and "as fast as herring" in proc.stdout


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_bench_collective(tmp_path, collective):
    """Each other collective with every peer that has it, every rank's result
    checked against numpy, and the report naming it and what lacks it."""
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax.bench", "-n", "2", "--sizes-mib", "1",
         "--iters", "2", "--warmup", "1", "--collective", collective, "--json", str(out),
         "--plot", str(plot)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    # As in the test above: every peer but torch_gloo on Python 3.12 and later.
    no_torch = sys.version_info[:2] != (3, 11) and importlib_util.find_spec("torch") is None
    assert data["collectives"] == [collective]
    assert data["missing"] == ({"torch_gloo": "torch not installed (pip install torch==2.13.0)"}
                               if no_torch else {}), data["missing"]
    ran = {"reduce_scatter": ["herring", "jax_psum", "mpi4py", "torch_gloo"],
           "all_gather": ["herring", "jax_psum", "mpi4jax", "mpi4py", "torch_gloo"]}[collective]
    ran = [p for p in ran if not (no_torch and p == "torch_gloo")]
    assert sorted(r["peer"] for r in data["results"]) == ran
    assert all(r["collective"] == collective and r["correct"] for r in data["results"])
    assert f"\n{collective}: " in proc.stdout and "herring at 1 MiB: " in proc.stdout
    if collective == "reduce_scatter":
        assert data["unsupported"] == {collective: {"mpi4jax": "mpi4jax (0.9) has no "
                                                               "reduce-scatter"}}
        assert "UNSUPPORTED: mpi4jax reduce_scatter" in proc.stdout
    # One host: (n+1)/2 * bytes through memory, a bound of half the all-reduce's
    # n * bytes at n = 2 plus a quarter.
    assert data["bounds_s"][collective]["1.0"] == pytest.approx(
        1.5 * 2**20 / (data["memory_gbps"] * 1e9))
    assert "bound_s" not in data  # the all-reduce's key, for all-reduce runs
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_collective_bounds():
    from herring_jax._src.tools.bench import collectives as coll
    mib = 2**20
    # 4 hosts over a 1 GB/s link: an all-reduce moves 2 x 3/4 of the buffer
    # each way, either half 3/4.
    assert coll.bound_s("allreduce", mib, 4, 1.0) == pytest.approx(1.5 * mib / 1e9)
    for c in ("reduce_scatter", "all_gather"):
        assert coll.bound_s(c, mib, 4, 1.0) == pytest.approx(0.75 * mib / 1e9)
        assert coll.bound_s(c, mib, 4, 1.0, "link", hosts=2) == pytest.approx(0.5 * mib / 1e9)
        assert coll.bound_s(c, mib, 4, 1.0, "link", hosts=1) is None
        assert coll.bound_s(c, mib, 4, 2.0, "memory") == pytest.approx(2.5 * mib / 2e9)
    # Sizes that do not divide by n round up, so that every peer moves the same parts.
    assert coll.elements(1, "reduce_scatter", 3) == 87382 * 3
    assert coll.elements(1, "allreduce", 3) == 2**18
    n, count = 3, coll.elements(1, "all_gather", 3)
    got = np.concatenate([coll.local_input("all_gather", count, r, n) for r in range(n)])
    assert all(np.array_equal(coll.expected("all_gather", count, r, n), got) for r in range(n))
    total = coll.pattern(count, 0) * 6
    assert np.array_equal(np.concatenate(
        [coll.expected("reduce_scatter", count, r, n) for r in range(n)]), total)
    with pytest.raises(ValueError, match="known: allreduce, reduce_scatter, all_gather"):
        coll.parse("allreduce,allgather")


def test_missing_peer_is_reported_not_dropped(tmp_path, monkeypatch):
    from herring_jax._src.tools.bench import peers
    monkeypatch.setattr(peers.importlib_util, "find_spec",
                        lambda name: None if name == "torch" else object())
    assert peers.missing_peers(["herring", "torch_gloo"]) == {
        "torch_gloo": "torch not installed (pip install torch==2.13.0)"}


class _FlakyPeer:
    """Sums in place into one reused buffer, like mpi4py's and torch's peers,
    and gets run number `bad` (counting warm-ups) wrong at one value."""

    def __init__(self, bad):
        self.bad, self.calls = bad, 0

    def prepare(self, local):
        self.out = np.empty_like(local)

    def reset(self):
        self.out.fill(-1)  # an in-place peer's next run overwrites the last result

    def run(self):
        self.calls += 1
        np.copyto(self.out, self.expected)
        if self.calls == self.bad:
            self.out[5] += 1
        return self.out

    @staticmethod
    def result(out):
        return out


@pytest.mark.parametrize("bad, run", [(3, "timed run 2 of 3"), (1, "warm-up run 1 of 1")])
def test_every_run_is_checked_not_only_the_last(bad, run):
    from herring_jax._src.tools.bench.worker import measure, pattern
    local = pattern(1000, 1)
    peer = _FlakyPeer(bad)
    peer.expected = pattern(1000, 0) * np.float32(3)
    times, wrong = measure(peer, local, peer.expected, iters=3, warmup=1)
    assert len(times) == 3 and peer.calls == 4
    assert wrong == [{"run": run, "what": "1 of 1000 values wrong, the first at [5]: "
                                           "got 19.0, expected 18.0"}]


def test_a_wrong_run_fails_the_report_naming_run_size_peer_and_rank():
    from herring_jax._src.tools.bench import report
    ok = {"times": [1.0, 2.0], "correct": True, "wrong_runs": []}
    bad = dict(ok, correct=False, wrong_runs=[{"run": "timed run 2 of 2", "what": "x"}])
    per_rank = [[dict(ok, mib=1.0, peer="herring"), dict(ok, mib=1.0, peer="mpi4py")],
                [dict(ok, mib=1.0, peer="herring"), dict(bad, mib=1.0, peer="mpi4py")]]
    results = report.summarize(report.cases("allreduce", [1.0], ["herring", "mpi4py"]), per_rank)
    assert [r["correct"] for r in results] == [True, False]
    assert results[1]["wrong_ranks"] == [1]
    # The JSON keeps its keys: the detail goes to the printed lines.
    assert set(results[0]) == {"collective", "mib", "peer", "median_s", "min_s", "times_s",
                               "times_by_rank_s", "correct", "wrong_ranks"}
    assert report.wrong_lines(per_rank) == [
        "WRONG RESULT: peer mpi4py, 1 MiB, timed run 2 of 2, rank 1: x"]


def test_flow_bound_of_each_server_layout():
    """The servers' bound (ceiling.py): a host's flows share its link alike, each
    capped; unequal flows end with the larger ones alone at the cap."""
    from herring_jax import _herring_ffi
    from herring_jax._src.tools.bench import ceiling
    # Two flows of 1 and 3 bytes on a link of 32 bit/s: 16 each for 0.5 s, then the
    # second alone; capped at 16 bit/s, it cannot take the link the first left.
    assert ceiling.fair_time_s([1, 3], 32, 1e9) == pytest.approx(1.0)
    assert ceiling.fair_time_s([1, 3], 32, 16) == pytest.approx(1.5)
    assert ceiling.fair_time_s([0, 0], 32, 16) == 0
    host, flow, b = 1e9, 250e6, 64 * 2**20
    unit = b * 8 / host  # B / H
    # 4 workers, no servers: 3 flows of B/2 each way at the flow cap, 2 B/H.
    assert ceiling.flow_bound_s(4, 0, 0.0, b, host, flow) == pytest.approx(2 * unit)
    # 4 servers taking everything: 4 flows of B/4 at the cap, B/H (2.0x).
    assert ceiling.flow_bound_s(4, 4, 1.0, b, host, flow) == pytest.approx(unit)
    # 2 servers: at 0.6 the flows to the servers carry 0.3 B against 0.2 B to the
    # workers, so all 5 share the link (1.0 B/H) and then the 2 alone run at the
    # cap (0.4 B/H); the equal flows of 0.5 take 1.25 B/H.
    assert ceiling.flow_bound_s(4, 2, 0.6, b, host, flow) == pytest.approx(1.4 * unit)
    assert ceiling.flow_bound_s(4, 2, 0.5, b, host, flow) == pytest.approx(1.25 * unit)
    plan = ceiling.flow_bytes(4, 2, 0.5, b)
    assert plan[0] == [0, b / 4, b / 4, b / 4, b / 4, b / 4]  # every flow of a worker alike
    assert plan[4] == [b / 4] * 4 + [0, 0]  # a server to the workers only
    # The engine's default split is that of equal flows: the best of the fair model.
    for k in (1, 2, 3):
        x = _herring_ffi.server_share(4, k)
        row = [v for v in ceiling.flow_bytes(4, k, x, b)[0] if v]
        assert max(row) == pytest.approx(min(row)), (k, x, row)
        best = min(ceiling.flow_bound_s(4, k, s / 100, b, host, flow) for s in range(101))
        assert ceiling.flow_bound_s(4, k, x, b, host, flow) <= best * 1.0001, k
    assert _herring_ffi.server_share(4, 4) == 1.0
    assert _herring_ffi.server_share(4, 2, 0.25) == 0.25


def test_flow_bound_of_reduce_scatter_and_all_gather_through_servers():
    """A reduce-scatter's or all-gather's layout with servers (ceiling.flow_bytes):
    a share of each block, its sums to the owner alone or its owner's share on to the
    others; the bounds the servers guide quotes, and the engine's block split the
    fastest of the fair model for a reduce-scatter."""
    from herring_jax import _herring_ffi
    from herring_jax._src.tools.bench import ceiling
    host, flow, b = 1e9, 250e6, 64 * 2**20
    unit = b * 8 / host  # B / H
    block = b / 4
    for c in ("reduce_scatter", "all_gather"):
        # No servers: 3 flows of a block at the cap, B/H.
        assert ceiling.flow_bound_s(4, 0, 0.0, b, host, flow, c) == pytest.approx(unit)
    rs = ceiling.flow_bytes(4, 4, 0.5, b, "reduce_scatter")
    assert rs[0] == [0] + [block / 2] * 3 + [block / 2] * 4  # to owners, to servers: alike
    assert rs[4] == [block / 8] * 4 + [0] * 4  # each owner its block's eighth
    ag = ceiling.flow_bytes(4, 4, 0.5, b, "all_gather")
    assert ag[0] == [0] + [block / 2] * 3 + [block / 8] * 4
    assert ag[4] == [3 * block / 8] * 4 + [0] * 4  # the 3 other blocks' eighths
    bound = {(c, k): ceiling.flow_bound_s(4, k, _herring_ffi.block_share(4, k), b, host, flow,
                                          c)
             for c in ("reduce_scatter", "all_gather") for k in (2, 4)}
    assert bound["reduce_scatter", 2] == pytest.approx(5 / 6 * unit)  # 1.2x
    assert bound["reduce_scatter", 4] == pytest.approx(0.875 * unit)  # 1.14x
    assert bound["all_gather", 2] == pytest.approx(0.7083 * unit, rel=1e-3)  # 1.41x
    assert bound["all_gather", 4] == pytest.approx(0.59375 * unit)  # 1.68x
    for k in (1, 2, 4):
        x = _herring_ffi.block_share(4, k)
        assert x == pytest.approx(k / (4 + k))
        best = min(ceiling.flow_bound_s(4, k, s / 100, b, host, flow, "reduce_scatter")
                   for s in range(101))
        assert ceiling.flow_bound_s(4, k, x, b, host, flow, "reduce_scatter") <= best * 1.0001
    assert _herring_ffi.block_share(4, 2, 0.25) == 0.25


def test_bench_ceiling_times_raw_tcp_in_the_servers_layout(tmp_path):
    """--ceiling: raw TCP moves the layout's bytes on the simulated network after
    herring's runs; its times respect the flow bound (the shaping holds), and the
    all-reduce's bound is the servers' layout's."""
    from herring_jax._src.launcher import netns
    from herring_jax._src.tools.bench import ceiling
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax.bench", "-n", "2", "--netns",
         "--host-rate", "1gbit", "--flow-rate", "250mbit", "--servers", "1",
         "--sizes-mib", "1,4", "--iters", "2", "--warmup", "1", "--peers", "herring",
         "--ceiling", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "network ceiling: raw TCP between 2 worker hosts" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert all(r["correct"] for r in data["results"])
    big, small = data["ceiling"]["4.0"], data["ceiling"]["1.0"]
    # 4 MiB reaches the servers (HERRING_SERVER_MIN_BYTES, 4 MiB): n = 2, k = 1
    # puts half on the server; 1 MiB stays on the workers, the server's host
    # idle beside them as in herring's run.
    assert (big["servers"], big["share"]) == (1, 0.5)
    assert (small["servers"], small["share"]) == (1, 0.0)
    bound = ceiling.flow_bound_s(2, 1, 0.5, 4 * 2**20, 1e9, 250e6)
    assert big["flow_bound_s"] == pytest.approx(bound)
    assert data["bound_s"]["4.0"] == pytest.approx(bound)
    assert data["bound_s"]["1.0"] == pytest.approx(ceiling.flow_bound_s(2, 0, 0, 2**20, 1e9,
                                                                          250e6))
    # No run beats the shaped bound by more than htb's bursts allow.
    assert len(big["runs_s"]) == 2 and min(big["runs_s"]) >= 0.9 * bound, big
    assert not netns.orphans()


def test_bench_netns_smoke(tmp_path):
    """The simulated-network mode: 2 hosts of 2 processes, shaped links, the
    bound from the shaped rates and the hosts, and nothing left behind."""
    from herring_jax._src.launcher import netns
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax.bench", "-n", "4", "--netns",
         "--processes-per-host", "2", "--host-rate", "1gbit", "--flow-rate", "500mbit",
         "--sizes-mib", "1,4", "--iters", "2", "--warmup", "1", "--peers", "herring,torch_gloo",
         "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "shaped: min(host 1gbit, 1 flow x 500mbit)" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert data["link_gbps"] == 500e6 / 8e9 and data["processes_per_host"] == 2
    # 2 hosts: each link carries 2(h-1)/h = 1 x the bytes.
    assert data["bound_s"]["4.0"] == pytest.approx(4 * 2**20 / (500e6 / 8))
    assert all(r["correct"] for r in data["results"])
    assert "domain eth0" in data["transport"]
    assert "2 processes on it, host stage through memory" in data["transport"]
    # Across the 2 hosts each process sends, of its 2 MiB slice, the half the
    # other host serves and the sum of the half it serves: 2 MiB, not 4 (a
    # process per host would send 4).
    [herring4] = [r for r in data["results"] if r["peer"] == "herring" and r["mib"] == 4.0]
    assert 2 * 2**20 <= herring4["bytes_sent_per_run"] < 2.1 * 2**20, herring4
    # orphans(), not leftovers(): a netns test beside this one holds its own.
    assert not netns.orphans()
