"""A small run of `herring-jax bench` keeps the benchmark working (timings are
not asserted: they are only meaningful as ratios inside one run)."""

import json
import subprocess
import sys


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
    # Every peer ran: .ci/install.sh installs them all, so none may be missing.
    assert data["missing"] == {}, data["missing"]
    peers = ["herring", "jax_psum", "mpi4jax", "mpi4py", "torch_gloo"]
    assert sorted((r["mib"], r["peer"]) for r in data["results"]) == sorted(
        (m, p) for m in (1.0, 4.0) for p in peers)
    assert all(r["correct"] and len(r["times_s"]) == 3 for r in data["results"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_peer_is_reported_not_dropped(tmp_path, monkeypatch):
    from herring_jax._src.bench import peers
    monkeypatch.setattr(peers.importlib_util, "find_spec",
                        lambda name: None if name == "torch" else object())
    assert peers.missing_peers(["herring", "torch_gloo"]) == {
        "torch_gloo": "torch not installed (pip install torch==2.13.0)"}


def test_bench_netns_smoke(tmp_path):
    """The simulated-network mode: 2 hosts, shaped links, the bound from the
    shaped rates, and nothing left behind."""
    from herring_jax._src import netns
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax.bench", "-n", "2", "--netns", "--host-rate",
         "1gbit", "--flow-rate", "500mbit", "--sizes-mib", "1,4", "--iters", "2", "--warmup", "1",
         "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "shaped: min(host 1gbit, 1 flow x 500mbit)" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert data["link_gbps"] == 500e6 / 8e9
    assert all(r["correct"] for r in data["results"])
    assert "domain eth0" in data["transport"]
    assert not netns.leftovers()
