"""The training examples run under the launcher with both reducers and learn."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from multiproc import FAST_COMPILE

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _launch(script, args, nproc=2, devices=1, fast_compile=False):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HERRING_TIMEOUT_S="120")
    env.pop("XLA_FLAGS", None)
    if fast_compile:
        # A fraction of the compile time, for runs of a few steps.
        env["XLA_FLAGS"] = FAST_COMPILE
    cmd = [sys.executable, "-m", "herring_jax.launch", "-n", str(nproc), "--devices-per-process",
           str(devices), "--timeout", "300", "--", sys.executable, script, *args]
    proc = subprocess.run(cmd, cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=330)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def _run(script, args, nproc=2, devices=1):
    proc = _launch(script, args, nproc, devices)
    done = [l for l in proc.stdout.splitlines() if "done:" in l]
    assert len(done) == 1, proc.stdout[-4000:]
    m = re.search(r"final loss ([\d.]+) \(first ([\d.]+)\)", done[0])
    return float(m.group(1)), float(m.group(2)), done[0]


@pytest.mark.parametrize("reduce", ["herring", "native"])
def test_mnist_like_learns(reduce):
    final, first, line = _run("train_mnist_like.py", ["--steps", "60", "--reduce", reduce])
    assert final < 0.5 * first, line
    accuracy = float(re.search(r"test accuracy ([\d.]+)", line).group(1))
    assert accuracy > 0.85, line


def test_pin_gives_each_process_its_own_core():
    proc = _launch("train_mnist_like.py", ["--steps", "5", "--pin"])
    for rank in range(2):
        assert f"process {rank} pinned to core {rank % os.cpu_count()}" in proc.stdout, \
            proc.stdout[-4000:]
    assert "done:" in proc.stdout, proc.stdout[-4000:]


def test_pin_outside_the_launcher_is_a_clear_error():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("HERRING_PROCESS_ID", None)
    proc = subprocess.run([sys.executable, "train_mnist_like.py", "--steps", "1", "--pin"],
                          cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--pin takes the rank from herring-jax launch" in proc.stderr, proc.stderr[-2000:]


def test_lm_loss_falls_with_two_devices_per_process():
    final, first, line = _run("train_lm.py", ["--steps", "15", "--log-every", "5",
                                              "--dim", "64", "--text-bytes", str(1 << 20)],
                              devices=2)
    assert final < first - 1.0, line


def test_run_demo_trains_and_checks(tmp_path):
    # The README's first command without its installs, on 2 processes and
    # fewer steps: progress lines, the one-line check, the loss-curve PNG.
    png = tmp_path / "loss.png"
    env = dict(os.environ, JAX_PLATFORMS="cpu", HERRING_DEMO_INSTALL="0",
               HERRING_DEMO_PROCESSES="2", HERRING_TIMEOUT_S="120",
               # The interpreter running the tests is the one herring_jax is installed for.
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(["bash", str(EXAMPLES / "run_demo.sh"), "--steps", "30",
                           "--log-every", "10", "--plot", str(png)],
                          env=env, capture_output=True, text=True, timeout=330)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    steps = re.findall(r"step +(\d+) +loss ([\d.]+) +step +[\d.]+ ms +reduced +([\d.]+) MiB",
                       proc.stdout)
    assert [int(s[0]) for s in steps] == [0, 10, 20, 29], out[-4000:]
    assert float(steps[-1][1]) < float(steps[0][1]), out[-4000:]
    assert float(steps[-1][2]) > 0, out[-4000:]
    verdicts = [l for l in proc.stdout.splitlines() if "within float32 rounding" in l]
    assert len(verdicts) == 1 and "OK: after 30 steps the parameters equal" in verdicts[0] \
        and "bitwise equal on 2 of 2 processes" in verdicts[0], out[-4000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quickstart_learns():
    # The getting-started page's first training script.
    proc = _launch("quickstart.py", [])
    losses = [float(v) for v in re.findall(r"step +\d+ +loss ([\d.]+)", proc.stdout)]
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], proc.stdout[-4000:]


# Every training-mode flag of data_parallel.py the docs mention, a few steps
# each, with a report (the held-out view of the parameters) at the first,
# a middle and the last step: each mode hands the report its own layout
# (local SGD a leading axis of one per device, fully sharded the gathered
# parameters).
_SHORT = ["--steps", "4", "--log-every", "2", "--batch", "8"]
_LM_SMALL = ["--dim", "32", "--layers", "1", "--context", "16", "--text-bytes", "200000"]
SMOKE = {
    "mnist-local-steps": ("train_mnist_like.py", ["--local-steps", "2"]),
    "mnist-streaming": ("train_mnist_like.py", ["--local-steps", "2", "--fragments", "2",
                                                "--delay", "0"]),
    "mnist-sharded-optimizer": ("train_mnist_like.py", ["--sharded-optimizer"]),
    "mnist-fully-sharded": ("train_mnist_like.py", ["--fully-sharded"]),
    "mnist-powersgd": ("train_mnist_like.py", ["--powersgd-rank", "2"]),
    "mnist-topk": ("train_mnist_like.py", ["--topk-fraction", "0.1"]),
    "mnist-compute-only": ("train_mnist_like.py", ["--reduce", "none"]),
    "lm-diloco-int8": ("train_lm.py", [*_LM_SMALL, "--local-steps", "2", "--outer", "diloco",
                                       "--compression", "int8"]),
    "lm-slowmo": ("train_lm.py", [*_LM_SMALL, "--local-steps", "2", "--outer", "slowmo"]),
    "lm-localsgd-streaming-delay": ("train_lm.py", [*_LM_SMALL, "--local-steps", "4",
                                                    "--outer", "sgd", "--fragments", "2",
                                                    "--delay", "1", "--mixing", "0.25"]),
    "lm-fully-sharded-reshard": ("train_lm.py", [*_LM_SMALL, "--fully-sharded",
                                                 "--reshard-after-forward", "--prefetch", "-1"]),
    "lm-native": ("train_lm.py", [*_LM_SMALL, "--reduce", "native"]),
    "lm-any-batch": ("train_lm.py", [*_LM_SMALL, "--micro-batches", "2", "--any-batch",
                                     "--slow-rank", "1", "--slowdown", "2"]),
    "lm-accordion": ("train_lm.py", [*_LM_SMALL, "--accordion", "int8,powersgd2",
                                     "--accordion-interval", "1"]),
}


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_every_training_mode_reports_and_finishes(name):
    script, args = SMOKE[name]
    proc = _launch(script, [*_SHORT, *args], fast_compile=True)
    what = "test accuracy" if script == "train_mnist_like.py" else "held-out loss"
    reports = [l for l in proc.stdout.splitlines() if "] step " in l and what in l]
    assert len(reports) == 3, proc.stdout[-4000:]
    done = [l for l in proc.stdout.splitlines() if "done:" in l]
    assert len(done) == 1 and what in done[0], proc.stdout[-4000:]


def _parsers_without_allow_abbrev_false(folder: Path) -> list[str]:
    """Every argparse.ArgumentParser(...) call under `folder` that leaves
    prefix matching on (allow_abbrev is not False)."""
    import ast
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "ArgumentParser"
                    and not any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant)
                                and k.value.value is False for k in node.keywords)):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_command_takes_a_prefix_of_a_flag_for_the_flag():
    # `--step 3` was taken as --steps, `--max-restart` as --max-restarts.
    root = EXAMPLES.parent
    assert not _parsers_without_allow_abbrev_false(EXAMPLES)
    assert not _parsers_without_allow_abbrev_false(root / "herring_jax")
    proc = subprocess.run([sys.executable, "train_mnist_like.py", "--step", "1"], cwd=EXAMPLES,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "unrecognized arguments: --step 1" in proc.stderr, proc.stderr[-2000:]


def test_lr_drops_multiply_the_learning_rate_by_a_tenth_from_each_step():
    import argparse
    import importlib

    import jax.numpy as jnp
    import optax

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        data_parallel = importlib.import_module("data_parallel")
    finally:
        sys.path.pop(0)
    plain = data_parallel.make_optimizer(argparse.Namespace(lr=0.1, lr_drops=(), optimizer="sgd"))
    dropped = data_parallel.make_optimizer(
        argparse.Namespace(lr=0.1, lr_drops=(3, 5), optimizer="sgd"))
    params = {"w": jnp.ones(4)}
    s1, s2 = plain.init(params), dropped.init(params)
    ratios = []
    for _ in range(7):
        u1, s1 = plain.update({"w": jnp.ones(4)}, s1, params)
        u2, s2 = dropped.update({"w": jnp.ones(4)}, s2, params)
        ratios.append(float(u2["w"][0] / u1["w"][0]))
    # The same momentum trace; the rate 0.1 before step 3, 0.01 from 3, 0.001 from 5.
    assert ratios == pytest.approx([1, 1, 1, 0.1, 0.1, 0.01, 0.01], rel=1e-5), ratios
