"""What a user sees of the command-line tools: `herring-jax bench` reports
progress while it runs, and --help shows the defaults and (train-bench) the
modes it refers to. (That train-bench finds its default training script from
any directory: test_train_bench.test_train_bench_smoke.)"""

import os
import re
import subprocess
import sys


def _help(tmp_path, *command):
    proc = subprocess.run([sys.executable, "-P", "-m", "herring_jax._src.cli", *command,
                           "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.split())  # argparse wraps lines anywhere


def test_bench_help_shows_defaults(tmp_path):
    text = _help(tmp_path, "bench")
    for expected in ("-n NUM_PROCESSES, --num-processes NUM_PROCESSES (default: 4)",
                     "buffer sizes in MiB (float32)", "(default: 1,16,64) --collective",
                     "timed runs per size and peer (default: 10)"):
        assert expected in text, text


def test_train_bench_help_describes_the_modes_it_names(tmp_path):
    text = _help(tmp_path, "train-bench")
    assert "see above" not in text, text
    assert "(see below)" in text and "With --codecs none,bf16,int8,powersgd4" in text, text
    assert "With --overlap it instead runs" in text and "(default: 60)" in text, text


def test_train_bench_default_script_ships_with_the_package(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-P", "-c", "import herring_jax, os; from herring_jax._src.tools import "
         "train_bench as t; s = t.default_script(); print(s); print(os.path.isfile(s)); "
         "print(os.path.isfile(os.path.join(os.path.dirname(s), 'data_parallel.py')))"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    script, exists, helper = proc.stdout.split()
    assert script.endswith(os.path.join("herring_jax", "examples", "train_lm.py")), script
    assert exists == helper == "True", proc.stdout


def test_bench_prints_progress_before_it_ends(tmp_path):
    # Through mpirun (an MPI peer), whose output used to arrive at the end:
    # the first progress line must come while the job still runs.
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "herring_jax.bench", "-n", "2", "--sizes-mib", "1",
         "--iters", "2", "--warmup", "1", "--peers", "herring,mpi4py"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, running_at_first = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[1/2]") and running_at_first is None:
                running_at_first = proc.poll() is None
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:] + proc.stderr.read()[-3000:]
    assert "started by mpirun" in out, out
    progress = [l for l in lines if l.startswith("[")]
    assert [l.split(":")[0] for l in progress] == ["[1/2] allreduce 1 MiB herring",
                                                  "[2/2] allreduce 1 MiB mpi4py"]
    assert running_at_first, out
    # The progress comes before the table of every rank's figures.
    table = next(i for i, l in enumerate(lines) if "herring x" in l)
    assert lines.index(progress[-1]) < table, out


def test_latency_phases_prints_each_phase(tmp_path):
    # The tool behind BENCHMARKS.md's small-buffer phases: a short run on 2
    # processes prints every phase, each a number of microseconds.
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax.launch", "-n", "2", "--", sys.executable, "-P",
         "-m", "herring_jax._src.tools.latency_phases", "--count", "1", "--iters", "20"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [line] = [l for l in proc.stdout.splitlines() if "processes, 4 bytes, 20 runs" in l]
    phases = dict(re.findall(r"(skew|dispatch|hop|first end|last end|ready|total) (\d+)", line))
    assert set(phases) == {"skew", "dispatch", "hop", "first end", "last end", "ready",
                           "total"}, line
    assert int(phases["total"]) > 0, line


def test_startup_phases_prints_each_phase(tmp_path):
    # The tool behind the getting-started guide's start-up table: 2 processes,
    # 3 steps; every phase printed once by rank 0, each a number of seconds.
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax.launch", "-n", "2", "--", sys.executable, "-P",
         "-m", "herring_jax._src.tools.startup_phases", "--steps", "3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = dict(re.findall(r"\[rank 0\] (.+?)\s+(\d+\.\d\d) s$", proc.stdout, re.M))
    assert set(found) == {"import jax, optax", "import herring_jax", "initialize()",
                          "optimizer init (with its check)", "first step (compile)",
                          "2 more steps", "shutdown() (rank 0)", "total (rank 0)"}, proc.stdout
    assert float(found["total (rank 0)"]) > 0, proc.stdout
