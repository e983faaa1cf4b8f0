"""Runs a worker script on N real processes through `herring-jax launch` and
collects the `HERRING_RESULT` lines each rank printed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
_LINE = re.compile(r"^\[rank (\d+)\] HERRING_RESULT (.*)$")


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, nproc: int):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.results: dict[int, list[dict]] = defaultdict(list)
        for line in proc.stdout.splitlines():
            m = _LINE.match(line)
            if m:
                self.results[int(m.group(1))].append(json.loads(m.group(2)))
        self.nproc = nproc

    def explain(self) -> str:
        return (f"exit code {self.returncode}\n--- stdout (tail) ---\n{self.stdout[-6000:]}"
                f"\n--- stderr (tail) ---\n{self.stderr[-6000:]}")


def _flags_xla_knows(*flags: str) -> str:
    """`flags` joined, less those this jaxlib's XLA does not know (an
    unknown flag in XLA_FLAGS kills the process at its first computation):
    asked once of a child process, for all of them at once, then one at a
    time only if that fails."""
    def accepted(tried):
        code = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
        # In the temporary directory: a refused flag aborts the child, which
        # may leave a core file where it ran.
        proc = subprocess.run(
            [sys.executable, "-P", "-c", code], cwd=tempfile.gettempdir(),
            env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(tried)},
            capture_output=True, text=True, timeout=120, check=False)
        return proc.returncode == 0
    if accepted(flags):
        return " ".join(flags)
    return " ".join(f for f in flags if accepted([f]))


# XLA_FLAGS for a test that compares two different compiled programs
# bitwise (sharded_optimizer's against the unsharded chain's, say) or one
# against a numpy model: XLA:CPU without LLVM's optimizations, which would
# contract a multiply and an add into one fused multiply-add differently in
# the two programs (test_sharded.py says more).
BITWISE_COMPILE = "--xla_backend_optimization_level=0"

# The other workers' XLA_FLAGS. Each worker compiles many small programs,
# and compiling them is most of the suite's CPU time:
# - without LLVM's optimizations (level 0) in about half the time;
# - with XLA:CPU's loop emitters instead of its MLIR fusion emitters, where
#   this jaxlib still has the choice (jax 0.10; 0.12 has only the MLIR ones),
#   in about 40% less again: a small jitted program took 71 ms of CPU to
#   lower and compile against 39 ms, and test_compat's and test_collectives'
#   2x2 layouts 117 s of CPU against 74 s (2026-11-30).
# Not for the bitwise tests above: under the loop emitters an adamw step of
# sharded_optimizer differed from the unsharded chain's in the last bit, and
# DiLoCo's and int8's steps from their numpy models.
FAST_COMPILE = _flags_xla_knows(BITWISE_COMPILE, "--xla_cpu_use_fusion_emitters=false")


def launch(worker: str, args: list[str], nproc: int, devices: int = 1,
           env: dict[str, str] | None = None, timeout: float = 600,
           hosts: int | None = None, platform: str = "cpu", servers: int = 0) -> Run:
    """Runs tests/workers/<worker> on `nproc` processes with `devices` CPU devices each.

    hosts: run them as that many simulated hosts (network namespaces, needs
    root), nproc / hosts consecutive ranks on each; the workers learn the
    layout from HERRING_TEST_HOSTS ("HxP") for their numpy reference.
    servers: also start that many server-only processes (launch --servers);
    their HERRING_RESULT lines are collected under their ranks nproc, nproc+1...
    platform: the ranks' JAX_PLATFORMS. The suite runs on CPU devices, set
    here rather than inherited so that a GPU on the test machine changes
    nothing; the GPU check (tests/gpu/checks.py) passes "cuda", and then each
    rank has the devices the platform gives it (`devices` must be 1).
    """
    full_env = dict(os.environ)
    # XLA:CPU without LLVM's optimizations compiles the workers' many small
    # programs in about half the time; a test that needs them passes its own
    # XLA_FLAGS (an empty string for XLA's defaults).
    full_env["XLA_FLAGS"] = FAST_COMPILE
    full_env["JAX_PLATFORMS"] = platform
    full_env.setdefault("HERRING_TIMEOUT_S", "120")
    full_env.update(env or {})
    layout = []
    if hosts is not None:
        assert nproc % hosts == 0, (nproc, hosts)
        layout = ["--netns", "--processes-per-host", str(nproc // hosts)]
        # The order the workers' reference sums in, unless the test says
        # otherwise (a job that falls back to the flat path sums in rank order).
        full_env.setdefault("HERRING_TEST_HOSTS", f"{hosts}x{nproc // hosts}")
    if platform == "cpu":
        layout += ["--devices-per-process", str(devices)]
    else:
        assert devices == 1, "only CPU devices can be multiplied per process"
    cmd = [sys.executable, "-m", "herring_jax.launch", "-n", str(nproc),
           "--timeout", str(int(timeout)), *layout,
           *(["--servers", str(servers)] if servers else []), "--",
           sys.executable, str(WORKERS / worker), *args]
    # cwd=tests/: `-m` puts the cwd on sys.path, and the source tree's
    # herring_jax (without the compiled extension) must not shadow the installed one.
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parent, env=full_env, capture_output=True, text=True,
                          timeout=timeout + 30)
    return Run(proc, nproc)


def fault_run(args, nproc, env=None):
    """tests/workers/fault_worker.py's results, its run having succeeded:
    rank -> its `reduce` results, and rank -> its stats after them."""
    run = launch("fault_worker.py", args, nproc=nproc, env={"HERRING_TIMEOUT_S": "60",
                                                             **(env or {})})
    assert run.returncode == 0, run.explain()
    reduces = {r: [x for x in rs if x["case"] == "reduce"] for r, rs in run.results.items()}
    stats = {r: [x for x in rs if x["case"] == "stats"][0]["stats"]
             for r, rs in run.results.items()}
    assert sorted(reduces) == list(range(nproc)), run.explain()
    return run, reduces, stats


def assert_each_file_has_one_writer(run: Run, root, cases: tuple[str, ...]) -> None:
    """A checkpoint's files, as the workers' `cases` results record the
    writes under `root`: each written by one process, none through a
    writable memory map, and every process wrote some."""
    writers = defaultdict(set)
    for rank, results in run.results.items():
        saves = [r for r in results if r["case"] in cases]
        assert saves, f"rank {rank} reported none of {cases}"
        for save in saves:
            assert not save["maps"], f"rank {rank} wrote through memory maps: {save['maps']}"
            mine = [p for p in save["writes"] if p.startswith(str(root))]
            # The recording saw this process's writes.
            assert mine, (rank, save["writes"])
            for path in mine:
                writers[path].add(rank)
    shared = {p: sorted(r) for p, r in writers.items() if len(r) > 1}
    assert not shared, f"files written by several processes: {shared}"


def assert_all_ok(run: Run, expected_cases: int | None = None) -> dict[str, set[str]]:
    """Every rank reported every case ok; returns case -> set of digests."""
    assert run.returncode == 0, run.explain()
    assert sorted(run.results) == list(range(run.nproc)), run.explain()
    digests: dict[str, set[str]] = defaultdict(set)
    counts = {r: len(v) for r, v in run.results.items()}
    assert len(set(counts.values())) == 1, f"ranks reported different case counts {counts}"
    if expected_cases is not None:
        assert counts[0] == expected_cases, f"{counts[0]} cases, expected {expected_cases}"
    bad = [(r, res["case"]) for r, rs in run.results.items() for res in rs if not res["ok"]]
    assert not bad, f"wrong results (rank, case): {bad[:20]}\n{run.explain()}"
    for rs in run.results.values():
        for res in rs:
            if "digest" in res:
                digests[res["case"]].add(res["digest"])
    return digests


def train_bench_codecs(tmp_path: Path, codecs: str, steps: int, timeout: float = 600,
                       nproc: int = 2) -> tuple[subprocess.CompletedProcess, dict]:
    """`herring-jax train-bench --codecs` on a tiny train_lm (nproc processes
    over the transport, a held-out loss every 2 steps, compiled at XLA's
    optimization level 0, as every test's processes are): the finished process
    (asserted to have succeeded) and its JSON results by codec name."""
    out = tmp_path / "codecs.json"
    proc = subprocess.run(
        [sys.executable, "-m", "herring_jax._src.tools.train_bench", "-n", str(nproc),
         "--steps", str(steps), "--codecs", codecs, "--log-every", "2",
         f"--xla-flags={FAST_COMPILE}", "--script",
         str(ROOT / "examples" / "train_lm.py"), "--json", str(out), "--", "--dim", "32",
         "--layers", "1", "--text-bytes", str(1 << 18)],
        cwd=tmp_path, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, {r["codec"]: r for r in json.loads(out.read_text())["results"]}
