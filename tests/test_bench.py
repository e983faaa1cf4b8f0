"""A small run of `herring-jax bench` keeps the benchmark working (timings are
not asserted: they are only meaningful as ratios inside one run)."""

import json
import subprocess
import sys


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "herring_jax.bench", "-n", "2", "--sizes-mib", "1,4",
         "--iters", "3", "--warmup", "1", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "herring x" in proc.stdout and "jax_psum" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert data["n"] == 2
    assert {(r["mib"], r["peer"]) for r in data["results"]} == {
        (1.0, "herring"), (1.0, "jax_psum"), (4.0, "herring"), (4.0, "jax_psum")}
    assert all(r["correct"] and len(r["times_s"]) == 3 for r in data["results"])
