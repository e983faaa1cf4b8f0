"""A small run of `herring-jax train-bench` keeps the training benchmark working
(step times are not asserted: they are only meaningful as ratios in one run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from multiproc import FAST_COMPILE, train_bench_codecs

ROOT = Path(__file__).resolve().parent.parent


def test_train_bench_smoke(tmp_path):
    # Through the CLI from a directory of its own, with the training script it
    # ships (herring_jax/examples/train_lm.py): it runs from anywhere.
    out = tmp_path / "train.json"
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax._src.cli", "train-bench", "-n", "2",
         "--steps", "6", "--reducers", "herring,none", "--json", str(out),
         f"--xla-flags={FAST_COMPILE}", "--", "--dim",
         "32", "--layers", "1", "--text-bytes", str(1 << 18)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "scaling eff" in proc.stdout and "comm eff" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    runs = {(r["reduce"], r["processes"]): r for r in data["results"]}
    assert set(runs) == {("herring", 1), ("herring", 2), ("none", 1), ("none", 2)}
    assert all(r["median_step_ms"] > 0 for r in runs.values())
    assert runs[("herring", 2)]["scaling_efficiency"] > 0
    assert "comm_efficiency" in runs[("herring", 2)]
    # Averaged gradients differ from a lone process's: the runs really reduced.
    assert runs[("herring", 2)]["final_loss"] != runs[("none", 2)]["final_loss"]


def test_train_bench_overlap_smoke(tmp_path):
    # --overlap on 2 processes of one host, a tiny MLP: every rank reports its
    # times, the three bounds and the bitwise check, and the timeline PNG is
    # written. Every bound is a hidden fraction: at most 1. (Times are not
    # compared: they are only meaningful as ratios in one run.)
    out, plot = tmp_path / "overlap.json", tmp_path / "overlap.png"
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax._src.cli", "train-bench", "-n", "2",
         "--overlap", "--json", str(out), "--plot", str(plot), "--", "--steps", "3",
         "--layers", "3", "--width", "64", "--batch", "64"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "after the forward pass and the last layer's gradients alone" in proc.stdout, \
        proc.stdout
    data = json.loads(out.read_text())
    results = data["results"]
    assert sorted(r["rank"] for r in results) == [0, 1], results
    for r in results:
        assert r["bitwise_equal_to_unoverlapped"] is True, r
        assert r["reductions_per_step"] >= 1, r
        for key in ("forward_ms", "first_gradient_ms", "first_issue_ms", "step_ms"):
            assert r[key] > 0, (key, r)
        for key in ("hidden_fraction_bound", "hidden_fraction_bound_at_first_gradient",
                    "hidden_fraction_bound_at_first_issue"):
            assert r[key] <= 1.0 + 1e-9, (key, r)
    assert plot.stat().st_size > 0


def test_train_bench_gives_every_run_its_xla_flags_and_drops_the_callers(monkeypatch):
    # The suite's runs compile at level 0 (--xla-flags), as its other processes
    # do; without the option a caller's forced device count does not reach them.
    import argparse

    from herring_jax._src.tools.train_bench import _run_env
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert "XLA_FLAGS" not in _run_env(argparse.Namespace(xla_flags=None))
    assert _run_env(argparse.Namespace(xla_flags=FAST_COMPILE))["XLA_FLAGS"] == FAST_COMPILE


def test_train_bench_rejects_a_missing_script(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "herring_jax._src.tools.train_bench", "--script", "nope.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "no training script" in proc.stderr, proc.stderr


def test_train_bench_codecs_smoke(tmp_path):
    # Two codecs on 2 processes over the transport: held-out losses, the
    # bytes each step sent (int8 about a quarter of none's), the JSON.
    proc, runs = train_bench_codecs(tmp_path, "none,int8", steps=6)
    assert "HERRING_HOST_STAGE=0" in proc.stdout, proc.stdout
    assert set(runs) == {"none", "int8"}
    assert [s for s, _ in runs["int8"]["held_out_curve"]] == [0, 2, 4, 5]
    # int8 sends about a quarter of the gradient bytes (plus losses, heartbeats).
    assert 2.5 < runs["int8"]["bytes_reduction"] < 4.1, runs
    # Lossy, so not the same model; error feedback keeps it close.
    assert runs["int8"]["held_out_loss"] != runs["none"]["held_out_loss"]
    assert abs(runs["int8"]["loss_vs_none"]) < 0.05, runs


def test_train_bench_fully_sharded_columns(tmp_path):
    # allreduce_gradients, sharded_optimizer and fully_sharded side by side:
    # the same model trained (held-out losses within float rounding), and what
    # each process holds between steps: the whole parameters and adamw's
    # state, then 1/N of the state, then 1/N of both. (The fully-reshard
    # column adds the example's --reshard-after-forward, whose codec name
    # test_local_sgd parses and whose memory test_fully_sharded measures.)
    proc, runs = train_bench_codecs(tmp_path, "none,sharded,fully", steps=4, timeout=900)
    assert "held MiB" in proc.stdout and "temp MiB" in proc.stdout, proc.stdout
    none, sharded, fully = runs["none"], runs["sharded"], runs["fully"]
    for r in runs.values():
        assert abs(r["held_out_loss"] - none["held_out_loss"]) < 1e-3, runs
        assert r["step_temp_mib"] > 0, r
    # adamw: parameters 1x + state 2x whole; sharded 1x + 2x/2; fully (1x + 2x)/2.
    assert abs(sharded["held_mib_per_process"] / none["held_mib_per_process"] - 2 / 3) < 0.02
    assert abs(fully["held_mib_per_process"] / none["held_mib_per_process"] - 1 / 2) < 0.02


def test_train_bench_codecs_over_seeds(tmp_path):
    # PowerSGD with bf16 factors and two power iterations, against none, on
    # two seeds: each seed reaches the script, and the row is their mean.
    out = tmp_path / "seeds.json"
    proc = subprocess.run(
        [sys.executable, "-m", "herring_jax._src.tools.train_bench", "-n", "2", "--steps", "4",
         "--codecs", "none,powersgd2-bf16-it2", "--seeds", "0,1", "--log-every", "2",
         f"--xla-flags={FAST_COMPILE}",
         "--script", str(ROOT / "examples" / "train_lm.py"), "--json", str(out), "--plot",
         str(tmp_path / "seeds.png"), "--", "--dim", "32", "--layers", "1", "--text-bytes",
         str(1 << 18)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "powersgd2-bf16-it2 (seed 1): held-out loss" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert data["seeds"] == [0, 1]
    runs = {r["codec"]: r for r in data["results"]}
    for r in runs.values():
        assert [s["seed"] for s in r["seeds"]] == [0, 1]
        losses = [s["held_out_loss"] for s in r["seeds"]]
        assert losses[0] != losses[1], r  # another initialization and other batches
        assert abs(r["held_out_loss"] - sum(losses) / 2) < 1e-9, r
    psgd, none = runs["powersgd2-bf16-it2"], runs["none"]
    gaps = [p["held_out_loss"] / n["held_out_loss"] - 1
            for p, n in zip(psgd["seeds"], none["seeds"])]
    assert psgd["loss_vs_none_per_seed"] == gaps
    assert abs(psgd["loss_vs_none"] - sum(gaps) / 2) < 1e-12
    assert psgd["bytes_reduction"] > 1.5, psgd
    assert (tmp_path / "seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_bench_rejects_bad_codecs_and_seeds(tmp_path):
    script = str(ROOT / "examples" / "train_lm.py")
    for extra, message in ((["--codecs", "powersgd4-fp8"], "unknown codecs ['powersgd4-fp8']"),
                           (["--codecs", "none,int8,none"], "named twice"),
                           (["--codecs", "none", "--seeds", "0,0"], "distinct"),
                           (["--codecs", "none", "--seeds", "0,1", "--", "--seed", "3"],
                            "give the seeds with --seeds"),
                           (["--codecs", "none", "--seeds", "0,1", "--", "--seed=3"],
                            "give the seeds with --seeds"),
                           (["--seeds", "0,1"], "--seeds goes with --codecs")):
        proc = subprocess.run(
            [sys.executable, "-m", "herring_jax._src.tools.train_bench", "--script", script, *extra],
            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2 and message in proc.stderr, (extra, proc.stderr)


def test_train_bench_names_a_script_that_trained_something_else(tmp_path):
    # A script that ignores --powersgd-codec (it reports plain powersgd4)
    # must not pass for a run with bf16 factors.
    script = tmp_path / "plain_powersgd.py"
    script.write_text("print('done: held-out loss 2.0000, median step 1.0 ms, compression "
                      "powersgd4, sent 0.100 MiB per step', flush=True)\n")
    proc = subprocess.run(
        [sys.executable, "-m", "herring_jax._src.tools.train_bench", "-n", "2", "--steps", "2",
         "--codecs", "powersgd4-bf16", "--script", str(script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "reports powersgd4: does it take the options --powersgd-rank 4 --powersgd-codec bf16" \
        in proc.stderr, proc.stderr


@pytest.mark.timeout(1200)
def test_train_bench_with_servers_sends_less_and_trains_the_same(tmp_path):
    # 3 workers and, through --launch-args, 3 server-only processes taking
    # every gradient buffer (on this one host: the flat path): a worker then
    # sends each buffer B once instead of 2 (n-1)/n B = 1.33 B, and the
    # trained model is bitwise the same, so its held-out loss too. (--codecs
    # none: one run on 3 processes; --reducers adds a 1-process run, which
    # nothing here compares.)
    def bench(launch_args: str, name: str) -> dict:
        out = tmp_path / name
        proc = subprocess.run(
            [sys.executable, "-P", "-m", "herring_jax._src.cli", "train-bench", "-n", "3",
             "--steps", "6", "--codecs", "none", "--launch-args", launch_args, "--json",
             str(out), f"--xla-flags={FAST_COMPILE}", "--", "--dim", "32", "--layers", "1",
             "--text-bytes", str(1 << 18)],
            cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
            env={**os.environ, "HERRING_HOST_STAGE": "0", "HERRING_SERVER_MIN_BYTES": "0"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        [result] = json.loads(out.read_text())["results"]
        return result

    without, served = bench("", "without.json"), bench("--servers 3", "servers.json")
    assert served["held_out_loss"] == without["held_out_loss"], (served, without)
    assert served["sent_mib_per_step"] < 0.85 * without["sent_mib_per_step"], \
        (served, without)
