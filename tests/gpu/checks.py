"""The steps of the GPU check: `python tests/gpu/checks.py STEP`. run.sh runs
each under its own timeout with the environment it prepared (the extension
on PYTHONPATH, the carried libraries on LD_LIBRARY_PATH) and reads the last
line a step prints, `GPU_CHECK_SUMMARY <PASS|WARN|FAIL|SKIP> <what>`.

The platform is JAX_PLATFORMS's (run.sh sets cuda there; cpu is the dry run,
which skips only what needs CUDA and says so). Multi-process steps run the
existing test workers (tests/workers/) through tests/multiproc.py: two ranks
share the one GPU, one device each, and every result is compared with numpy
(XLA's own collectives between them would go to NCCL, which refuses two ranks
on one GPU).

A step whose workers reported every result right but exited non-zero is a
WARN, not a FAIL: herring threads still inside CUDA calls when the process
exits may crash it after the results are in (run.sh's expected problems).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/, for multiproc

import multiproc  # noqa: E402

PLATFORM = (os.environ.get("JAX_PLATFORMS") or "cuda").split(",")[0]
GPU = PLATFORM != "cpu"
# run.sh's scratch folder: logs (tarred into $OUT) and what steps hand on.
WORK = Path(os.environ.get("GPU_CHECK_WORK") or "/tmp/herring-gpu-check")
LOGS = WORK / "logs"
# Two processes on one GPU: neither may take most of its memory up front.
RANK_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4"}
ALL_DTYPES = "float32,float64,bfloat16,float16,int32,int64"
FLOATS = "float32,float64,bfloat16,float16"
# What the reduce steps run (reduce_worker.py): small and odd counts, a 1 MiB
# buffer of each dtype and a 16 MiB float32 one (several chunks and parts).
COUNTS, MIB, BIG_MIB = "0,1,7,4097", "1", "16"
REDUCE_SIZES = ["--counts", COUNTS, "--mib", MIB, "--big-mib", BIG_MIB]


def summary(status: str, text: str) -> int:
    print(f"GPU_CHECK_SUMMARY {status} {text}", flush=True)
    return 1 if status == "FAIL" else 0


def launch(worker: str, args: list[str], nproc: int, env: dict | None = None,
           timeout: float = 240) -> multiproc.Run | None:
    """multiproc.launch on this platform; None if it ran past `timeout`."""
    print(f"-- {nproc} x {worker} {' '.join(args)} {env or ''}", flush=True)
    start = time.monotonic()
    try:
        run = multiproc.launch(worker, args, nproc=nproc, env={**RANK_ENV, **(env or {})},
                               timeout=timeout, platform=PLATFORM)
    except subprocess.TimeoutExpired:
        print(f"   ran past {timeout} s", flush=True)
        return None
    print(f"   exit {run.returncode} after {time.monotonic() - start:.1f} s", flush=True)
    for rank, results in sorted(run.results.items()):
        for r in results:
            print(f"   [rank {rank}] {json.dumps(r)[:600]}", flush=True)
    return run


def judge(run: multiproc.Run | None, expected: int, what: str) -> tuple[str, str]:
    """(status, text) of a launch whose every rank should report `expected`
    cases, all ok (and, where they carry digests, the same on every rank)."""
    if run is None:
        return "FAIL", f"{what}: timed out"
    counts = {r: len(run.results.get(r, [])) for r in range(run.nproc)}
    bad = [(r, c["case"]) for r, cs in run.results.items() for c in cs if not c["ok"]]
    digests = defaultdict(set)
    for cs in run.results.values():
        for c in cs:
            if "digest" in c:
                digests[c["case"]].add(c["digest"])
    split = sorted(k for k, v in digests.items() if len(v) > 1)
    complete = all(n == expected for n in counts.values())
    if complete and not bad and not split:
        if run.returncode == 0:
            return "PASS", f"{what}: {expected} cases right on {run.nproc} rank(s)"
        return "WARN", (f"{what}: all {expected} cases right, but the job exited "
                        f"{run.returncode} (expected problem 4: exit-time crash?)")
    print(run.explain(), flush=True)
    problems = []
    if not complete:
        problems.append(f"cases reported per rank {counts}, expected {expected}")
    if bad:
        problems.append(f"wrong: {bad[:6]}{' ...' if len(bad) > 6 else ''}")
    if split:
        problems.append(f"ranks differ in {split[:6]}")
    return "FAIL", f"{what}: {'; '.join(problems)} (exit {run.returncode})"


def reduce_cases(dtypes: str, ops: str, codecs: str = "none") -> int:
    """How many cases reduce_worker.py reports for these and REDUCE_SIZES (its cases())."""
    n = 0
    for dtype in dtypes.split(","):
        for op in ops.split(","):
            if not (op == "mean" and dtype.startswith("int")):
                n += len(COUNTS.split(",")) + len(MIB.split(","))
                n += len(BIG_MIB.split(",")) if dtype == "float32" else 0
    return n * len(codecs.split(","))


# -- steps ---------------------------------------------------------------------


def preflight() -> int:
    """GPU, OS, glibc, jax and its devices, the carried libraries, fi_info and
    a libfabric ping-pong over tcp on loopback (herring's transport here)."""
    failures = []

    def show(name, value):
        print(f"{name:>16}: {value}", flush=True)

    def command(args, timeout=30):
        try:
            p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
            return p.returncode, (p.stdout + p.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            return -1, str(e)

    release = Path("/etc/os-release")
    os_release = dict(line.split("=", 1) for line in release.read_text().splitlines()
                      if "=" in line) if release.exists() else {}
    show("os", os_release.get("PRETTY_NAME", "?").strip('"') + " / " + os.uname().release)
    show("glibc", os.confstr("CS_GNU_LIBC_VERSION"))
    show("python", sys.version.split()[0] + " " + sys.executable)
    show("cpus", os.cpu_count())
    if GPU:
        _, text = command(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                            "memory.used,compute_mode", "--format=csv,noheader"])
        show("nvidia-smi", text)  # informative only: jax's devices decide
    else:
        show("nvidia-smi", "skipped (CPU dry run)")
    import jax
    import jaxlib
    show("jax", f"{jax.__version__} (jaxlib {jaxlib.__version__})")
    try:
        devices = jax.devices()
        show("devices", f"{devices} ({devices[0].device_kind})")
        if GPU and devices[0].platform != "gpu":
            failures.append(f"jax has no GPU: {devices}")
    except Exception as e:  # RuntimeError, or jax 0.11's AssertionError without a backend
        show("devices", f"none: {type(e).__name__}: {e}")
        failures.append(f"jax found no {PLATFORM} devices")
    if GPU:
        try:
            stats = jax.devices()[0].memory_stats() or {}
            show("gpu memory", f"{stats.get('bytes_limit', 0) / 2**30:.1f} GiB for this process")
        except Exception as e:  # memory_stats is optional per backend
            show("gpu memory", f"unknown ({e})")
    carried = os.environ.get("GPU_CHECK_CARRIED", "")
    if carried:
        lib = Path(carried) / "usr/lib/x86_64-linux-gnu/libfabric.so.1"
        try:
            ctypes.CDLL(str(lib))  # its dependencies through LD_LIBRARY_PATH (run.sh)
            loaded = sorted({line.split()[-1] for line in open("/proc/self/maps")
                             if "libfabric.so" in line})
            show("carried libs", f"load: {loaded}")
        except OSError as e:
            show("carried libs", f"do not load: {e}")
            failures.append("the carried libfabric does not load")
    else:
        show("carried libs", "none (no .gpu/: the system's libfabric)")
    show("LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH", ""))
    fi_info = shutil.which("fi_info")
    if fi_info is None:
        failures.append("no fi_info")
        show("fi_info", "missing")
    else:
        rc, text = command([fi_info, "--version"])
        show("fi_info", f"{fi_info}: {' '.join(text.split())}")
        rc, text = command([fi_info, "-l"])
        show("providers", " ".join(line.strip().rstrip(":") for line in text.splitlines()
                                  if line.strip().endswith(":")))
        if rc != 0:
            failures.append("fi_info -l failed")
    pingpong = shutil.which("fi_pingpong")
    if pingpong:
        # herring's provider and endpoint type over loopback
        args = [pingpong, "-p", "tcp;ofi_rxm", "-e", "rdm", "-I", "100", "-S", "4096"]
        server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        time.sleep(0.5)
        rc, text = command(args + ["127.0.0.1"], 20)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        show("fi_pingpong", f"tcp;ofi_rxm loopback: {'ok' if rc == 0 else 'failed'}: "
             f"{text.splitlines()[-1] if text else ''}")
        if rc != 0:
            failures.append("fi_pingpong over tcp failed")
    if failures:
        return summary("FAIL", "; ".join(failures))
    where = f"{devices[0].device_kind}" if GPU else "CPU dry run"
    return summary("PASS", f"{where}, jax {jax.__version__}, glibc "
                   f"{os.confstr('CS_GNU_LIBC_VERSION').split()[-1]}")


def extension() -> int:
    """The herring_jax run.sh put in place imports, has the CUDA handlers
    (on a GPU), and loads libfabric from where run.sh said."""
    import herring_jax
    from herring_jax import _herring_ffi
    from herring_jax._src.process import jax_compat
    from herring_jax._src.process import knobs
    from herring_jax._src.process import runtime
    fabric = sorted({line.split()[-1] for line in open("/proc/self/maps")
                     if "libfabric.so" in line})
    print(f"herring_jax: {herring_jax.__file__}\nmodule: {_herring_ffi.__file__}\n"
          f"libfabric: {fabric}\nCUDA handlers: {runtime.cuda_handler_built()}\n"
          f"jax_compat: {jax_compat.__name__} imported", flush=True)
    if "HERRING_CUDA_DONE_GRACE_S" not in knobs.KNOBS:
        # An installed herring_jax older than this tree: the steps would test it.
        return summary("FAIL", f"{herring_jax.__file__} predates this tree (no "
                       "HERRING_CUDA_DONE_GRACE_S): pip install --no-build-isolation . first")
    if not runtime.cuda_handler_built():
        if GPU:
            return summary("FAIL", "the module has no CUDA handlers")
        return summary("PASS", f"imports; no CUDA handlers (CPU dry run: {fabric[0]})")
    return summary("PASS", f"imports with the CUDA handlers; libfabric {fabric[0]}")


def one_process() -> int:
    run = launch("one_process_worker.py", [], 1)
    dtypes = len(ALL_DTYPES.split(","))  # one case each, and the tree
    return summary(*judge(run, dtypes + 1,
                          f"jitted allreduce, {dtypes} dtypes x 20 inputs + a tree"))


def reduce(name: str) -> int:
    """Two ranks, reduce_worker.py, checked bitwise against numpy."""
    if name == "memory":
        # One host: the two processes reduce through each other's memory
        # (process_vm_readv of the pinned staging buffers on a GPU).
        args, env = ["--dtypes", ALL_DTYPES, "--ops", "sum,mean"], {"HERRING_HOST_STAGE": "1"}
        n, what = reduce_cases(ALL_DTYPES, "sum,mean"), "host stage on, 6 dtypes, 0..16 MiB"
    elif name == "transport":
        # Host stage off: every byte over libfabric (tcp), buffers registered
        # as EFA would need, and the wire codecs.
        codecs = "none,bf16"  # the codecs run on the host alike on every platform
        args = ["--dtypes", ALL_DTYPES, "--ops", "sum,mean", "--codec", codecs]
        env = {"HERRING_HOST_STAGE": "0", "HERRING_FI_FORCE_MR": "1"}
        n = reduce_cases(ALL_DTYPES, "sum,mean", codecs)
        what = f"host stage off, forced MR, codecs {codecs}, 6 dtypes"
    else:  # in-place
        # allreduce_gradients' mean: XLA:CPU reduces each bucket in its own
        # buffer, XLA:CUDA splits the buckets into starts and dones.
        args, env = ["--dtypes", FLOATS, "--ops", "mean", "--in-place"], {}
        n, what = reduce_cases(FLOATS, "mean"), "mean in place, 4 float dtypes"
    run = launch("reduce_worker.py", args + REDUCE_SIZES + ["--describe"], 2, env)
    status, text = judge(run, n + 1, what)
    if run is not None:
        described = [c.get("describe") for c in run.results.get(0, []) if c["case"] == "describe"]
        print(f"describe: {described}", flush=True)
    return summary(status, text)


def identity(mode: str) -> int:
    if mode == "match":
        # The platform's default identity (launch on XLA:CUDA), then ranks
        # whose executables of one program differ, under the launch identity.
        run = launch("identity_worker.py", ["match"], 2)
        status, text = judge(run, 4, "identity: helper twice, no wait, train/eval, loop")
        if status == "PASS":
            run = launch("identity_worker.py", ["different-programs"], 2,
                         {"HERRING_IDENTITY": "launch", "HERRING_TIMEOUT_S": "30"})
            status, text = judge(run, 1, f"{text}; executables differing per rank (launch "
                                 "identity)")
        return summary(status, text)
    # Rank 1 launches once more: another run id there; every rank must raise.
    # Only the program identity (XLA's run ids) can tell: under the launch
    # identity rank 1's first reduction pairs with rank 0's, as documented.
    run = launch("identity_worker.py", ["extra-launch"], 2,
                 {"HERRING_TIMEOUT_S": "3", "HERRING_IDENTITY": "program"})
    status, text = judge(run, 1, "identity: an extra launch fails every rank, one naming both runs")
    both = [r for r, cs in (run.results.items() if run else []) for c in cs
            if len(c.get("runs", [])) >= 2]
    if status == "PASS" and not both:
        status, text = "FAIL", f"{text}, but no rank's error named both runs"
    slow = [round(c["seconds"], 1) for cs in (run.results.values() if run else [])
            for c in cs if c.get("seconds", 0) >= 40]
    if status == "PASS" and slow:
        status, text = "FAIL", f"{text}, but only after {slow} s (limit 40)"
    return summary(status, text)


def flax_step() -> int:
    exchange = WORK / "exchange"
    shutil.rmtree(exchange, ignore_errors=True)
    # On a GPU, big enough that the backward pass (~1 TFLOP) outlasts a 16 MiB
    # bucket's reduction, or the timeline could not show overlap; small on CPU.
    size = (["--width", "2048", "--layers", "8", "--batch", "8192"] if GPU else
            ["--width", "128", "--layers", "4", "--batch", "64"])
    steps = 3
    run = launch("flax_step_worker.py", size + [
        "--steps", str(steps), "--exchange", str(exchange), "--hlo", str(LOGS / "step_hlo.txt"),
        "--timeline", str(LOGS / "timeline.json")], 2,
        # Reductions that never match (the ranks' run ids differ) fail after
        # 30 s, not 60: device time is scarce.
        {"HERRING_TIMEOUT_S": "30"})
    shutil.rmtree(exchange, ignore_errors=True)
    width, layers, batch = size[1::2]
    status, text = judge(run, steps + 1, f"Flax MLP {layers}x{width}, batch {batch}: reduced "
                         "gradients = numpy mean, parameters equal on both ranks")
    return summary(status, text + compare_ranks(LOGS / "step_hlo.txt.checked"))


def compare_ranks(prefix: Path) -> str:
    """Whether both ranks compiled the same checked_step: XLA's run id, which
    matches reductions across processes, has a base derived from the
    executable's fingerprint, so where they differ no reduction can match."""
    texts = []
    for rank in (0, 1):
        try:
            texts.append(Path(f"{prefix}.rank{rank}").read_text().splitlines())
        except OSError:
            return f"; rank {rank} wrote no compiled checked_step"
    a, b = texts
    if a == b:
        return "; both ranks compiled the same checked_step"
    if a[0] != b[0]:
        print(f"fingerprints: rank 0 {a[0]!r}, rank 1 {b[0]!r}")
    diffs = [i for i in range(1, max(len(a), len(b)))
             if i >= len(a) or i >= len(b) or a[i] != b[i]]
    if not diffs:
        return "; the ranks' checked_step HLO is equal but the fingerprints differ"
    print(f"the ranks' compiled checked_step differs on {len(diffs)} lines; the first 5:")
    for i in diffs[:5]:
        print(f"  line {i}:\n    rank 0: {a[i] if i < len(a) else '(none)'}\n"
              f"    rank 1: {b[i] if i < len(b) else '(none)'}")
    return f"; the ranks' compiled checked_step differs on {len(diffs)} lines (see steps.log)"


# What a line of the compiled HLO schedule is, for the overlap map.
_STARTS = ("herring_allreduce_start", "herring_allreduce")  # CUDA; CPU's asynchronous call
_DONES = ("herring_allreduce_done", "herring_join")
_KERNEL = re.compile(r"\s(fusion|custom-call|convolution|dot|reduce|scatter|gather|sort|call|"
                     r"while|conditional)\(")  # an opcode: operands are %names


def classify(line: str) -> str | None:
    m = re.search(r'custom_call_target="([^"]+)"', line)
    if m and m.group(1) in _STARTS:
        return "S"
    if m and m.group(1) in _DONES:
        return "D"
    if _KERNEL.search(line):
        return "k"  # a kernel (or a command buffer of them) the GPU runs
    return None


def overlap() -> int:
    """Where XLA scheduled each start against the backward pass's kernels
    (the compiled step's entry computation, in schedule order), and what the
    engine's timeline of those steps shows."""
    hlo_path, timeline_path = LOGS / "step_hlo.txt", LOGS / "timeline.json"
    if not hlo_path.exists():
        return summary("FAIL", "no compiled step from flax-step (did it run?)")
    text = hlo_path.read_text()
    entry = text[text.index("\nENTRY "):]
    entry = entry[:entry.index("\n}\n") if "\n}\n" in entry else len(entry)]
    marks = [c for c in map(classify, entry.splitlines()) if c]
    # Runs of kernels as k<count>: S k12 S k3 ... D D.
    compact, run = [], 0
    for c in marks + ["."]:
        if c == "k":
            run += 1
            continue
        if run:
            compact.append(f"k{run}")
            run = 0
        if c != ".":
            compact.append(c)
    schedule = " ".join(compact)
    print(f"schedule (S start, D done, kN: N kernels): {schedule}", flush=True)
    starts = [i for i, c in enumerate(marks) if c == "S"]
    dones = [i for i, c in enumerate(marks) if c == "D"]
    if not starts or not dones:
        return summary("FAIL", f"no starts or dones in the compiled step: {schedule[:200]}")
    first_done = min(dones)
    behind = [sum(1 for c in marks[s:first_done] if c == "k") for s in starts]
    print(f"kernels between each start and the first done: {behind}", flush=True)
    overlapped = sum(1 for k in behind if k > 0)

    timeline_note = ""
    if timeline_path.exists():
        t = json.loads(timeline_path.read_text())
        bounds, events = t["step_bounds_ns"], t["events"]
        for i in range(len(bounds) - 1):
            es = sorted((e for e in events if bounds[i] <= e["issued_ns"] < bounds[i + 1]),
                        key=lambda e: e["issued_ns"])
            rel = [(round((e["issued_ns"] - bounds[i]) / 1e6, 2),
                    round((e["begun_ns"] - bounds[i]) / 1e6, 2),
                    round((e["ended_ns"] - bounds[i]) / 1e6, 2)) for e in es]
            print(f"step {i} ({(bounds[i + 1] - bounds[i]) / 1e6:.1f} ms): "
                  f"(issued, begun, ended) ms per bucket {rel}", flush=True)
            if es:
                # A bucket reduced before the last bucket's bytes reached the
                # host: herring worked while the GPU still computed.
                first_end = min(e["ended_ns"] for e in es)
                last_begun = max(e["begun_ns"] for e in es)
                timeline_note = (f"; timeline: first bucket ended "
                                 f"{'before' if first_end < last_begun else 'after'} "
                                 f"the last began")
    kind = "CUDA start/done" if GPU else "CPU async call/join"
    text = (f"{kind}: {overlapped} of {len(starts)} starts have kernels after them before "
            f"the first done{timeline_note}")
    if not GPU:
        return summary("PASS", f"{text} (CPU dry run: the CUDA schedule needs a GPU)")
    if overlapped == 0:
        return summary("WARN", f"{text}: XLA sank every start next to its done, no overlap "
                       "(expected problem 1; results are still checked by flax-step)")
    return summary("PASS", text)


def failures() -> int:
    """Each failure raises HerringError on the surviving rank(s) within 40 s."""
    cases = [
        ("mismatch", ["mismatch"], {"HERRING_TIMEOUT_S": "3"}, 2),
        ("dead-peer", ["dead-peer"], {"HERRING_TIMEOUT_S": "120",
                                      "HERRING_PEER_TIMEOUT_S": "3"}, None),
        ("jit-dead-peer", ["jit-dead-peer", "caught"],
         {"HERRING_TIMEOUT_S": "120", "HERRING_PEER_TIMEOUT_S": "3"}, None),
    ]
    lines, worst = [], "PASS"
    for name, args, env, per_rank in cases:
        run = launch("failure_worker.py", args, 2, env, timeout=120)
        if run is None:
            status, text = "FAIL", "timed out"
        else:
            # dead-peer modes: only rank 0 survives to report.
            ranks = range(run.nproc) if per_rank else [0]
            results = [c for r in ranks for c in run.results.get(r, [])]
            seconds = [c.get("seconds") for c in results if "seconds" in c]
            ok = (run.returncode == 0 and results and all(c["ok"] for c in results)
                  and all(len(run.results.get(r, [])) == (per_rank or 1) for r in ranks)
                  and seconds and max(seconds) < 40)
            status = "PASS" if ok else "FAIL"
            text = f"HerringError after {[round(s, 1) for s in seconds]} s"
            if not ok:
                print(run.explain(), flush=True)
        lines.append(f"{name} {status} ({text})")
        worst = "FAIL" if "FAIL" in (worst, status) else worst
    return summary(worst, "; ".join(lines))


STEPS = {
    "preflight": preflight,
    "extension": extension,
    "one-process": one_process,
    "reduce-memory": lambda: reduce("memory"),
    "reduce-transport": lambda: reduce("transport"),
    "mean-in-place": lambda: reduce("in-place"),
    "identity": lambda: identity("match"),
    "identity-extra-launch": lambda: identity("extra-launch"),
    "flax-step": flax_step,
    "overlap": overlap,
    "failures": failures,
}


def main() -> int:
    # The halves' and the restart's steps (modules of their own, which import
    # this one's helpers).
    import halves_checks
    import restart_checks
    STEPS.update(halves_checks.STEPS)
    STEPS.update(restart_checks.STEPS)
    if len(sys.argv) != 2 or sys.argv[1] not in STEPS:
        print(f"usage: {sys.argv[0]} STEP, one of: {' '.join(STEPS)}", file=sys.stderr)
        return 2
    LOGS.mkdir(parents=True, exist_ok=True)
    try:
        return STEPS[sys.argv[1]]()
    except Exception as e:  # the step's own bug or a missing module: say so, do not hide it
        import traceback
        traceback.print_exc()
        return summary("FAIL", f"{type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    sys.exit(main())
