"""C++ unit tests of engine pieces, each built and run plainly (the core
tier: their checks, at a fraction of the build time), under ThreadSanitizer
and under AddressSanitizer + UBSan (the extended tier; clang, installed by
.ci/install.sh). A sanitizer report or a failed check fails the test. The
transport test runs two libfabric endpoints of one process over loopback."""

import os
import shutil
import subprocess
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# None: no sanitizer. The sanitized builds took 20-47 s each on 2 loaded
# cores (175 s for the five of the core tier), most of it compiling.
SANITIZERS = {"plain": None, "tsan": "thread", "asan-ubsan": "address,undefined"}


def _build_and_run(source: str, sanitizer: str, marker: str, extra_sources=(),
                   libs=()) -> None:
    clang = shutil.which("clang++")
    assert clang, "clang++ is missing: bash .ci/install.sh installs it"
    options = ["-std=c++17", "-g", *_sanitize(sanitizer)]
    with tempfile.TemporaryDirectory(prefix="herring_cpp_") as tmp:
        binary = os.path.join(tmp, source)
        objects = []
        for path in [os.path.join("tests", "cpp", source + ".cc"),
                     *[os.path.join("xla_ffi", s) for s in extra_sources]]:
            objects.append(os.path.join(tmp, f"{len(objects)}.o"))
            _run_compiler([*_cached(clang), *options, "-I", "xla_ffi", "-c", path, "-o",
                           objects[-1]])
        _run_compiler([clang, *options, *objects, "-o", binary, *libs, "-lpthread"])
        run = subprocess.run([binary], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "TSAN_OPTIONS": "halt_on_error=1",
                                  "ASAN_OPTIONS": "detect_leaks=1"})
    assert run.returncode == 0, run.stdout + run.stderr[-6000:]
    assert marker in run.stdout, run.stdout + run.stderr


def _cached(compiler: str) -> list[str]:
    """The compiler through ccache where it is installed (.ci/ccache.sh
    says why): each source compiles on its own, from the checkout's root with
    relative paths, so that a clone elsewhere finds the same entries."""
    ccache = shutil.which("ccache")
    if ccache is None or os.environ.get("HERRING_CCACHE") == "0":
        return [compiler]
    return [ccache, compiler]


def _run_compiler(command: list[str]) -> None:
    env = {**os.environ, "CCACHE_BASEDIR": ROOT, "CCACHE_NOHASHDIR": "1"}
    build = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=240)
    assert build.returncode == 0, " ".join(command) + "\n" + build.stderr[-4000:]


def _sanitize(sanitizer: str) -> list[str]:
    """The compiler's options: unsanitized builds unoptimised too (the
    quickest to compile; the checks are the same)."""
    if SANITIZERS[sanitizer] is None:
        return ["-O0"]
    return ["-O1", f"-fsanitize={SANITIZERS[sanitizer]}", "-fno-sanitize-recover=all"]


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_local_rendezvous(sanitizer):
    _build_and_run("local_rendezvous_test", sanitizer, "LOCAL_RENDEZVOUS_OK")


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_async_runner(sanitizer):
    # A finished task is destroyed outside the runner's lock: a slow
    # destructor holds up no hand-over, and one that hands over work does not
    # deadlock.
    _build_and_run("async_runner_test", sanitizer, "ASYNC_RUNNER_OK")


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_device_double(sanitizer):
    # The CPU double runs a stream as the CUDA handlers assume one runs:
    # copies in order on its own thread, events, sticky errors, the fault hook.
    _build_and_run("device_double_test", sanitizer, "DEVICE_DOUBLE_OK",
                   extra_sources=["device_double.cc"])


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_occurrence_table(sanitizer):
    _build_and_run("occurrence_table_test", sanitizer, "OCCURRENCE_TABLE_OK")


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_transport(sanitizer):
    # Every operation completes exactly once, also when receives are cancelled
    # while their messages arrive; queued posts complete in order.
    _build_and_run("transport_test", sanitizer, "TRANSPORT_OK",
                   extra_sources=["transport/fabric_setup.cc", "transport/fabric_posting.cc",
                                  "transport/fabric_progress.cc"], libs=["-lfabric"])


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_codecs_and_truncation_words(sanitizer):
    # Each codec's round trip and bounds; a truncated receive named for what
    # it is (the provider's loss, a mismatch, a tag collision).
    _build_and_run("codec_wire_test", sanitizer, "CODEC_WIRE_OK",
                   extra_sources=["engine/codec.cc", "engine/wire.cc"])


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_reduce_kernels(sanitizer):
    # Every dtype, whole blocks and tails, in place: the bits of the plain
    # element-by-element sum in source order.
    _build_and_run("reduce_kernels_test", sanitizer, "REDUCE_KERNELS_OK",
                   extra_sources=["engine/reduce_kernels.cc"])


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_chunking(sanitizer):
    # A quarter of the part between the two limits, rounded to 64 bytes (a
    # codec's block), never above the transport's message limit.
    _build_and_run("chunking_test", sanitizer, "CHUNKING_OK")


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_served_parts(sanitizer):
    # The share of each buffer that goes to server-only processes (BytePS's
    # split on links of one rate) and the parts it is cut into.
    _build_and_run("served_parts_test", sanitizer, "SERVED_PARTS_OK")


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_leave_ledger(sanitizer):
    # The leave protocol's counts: a receipt is due once, and only once every
    # message of the rank that left is in; confirmations need every message.
    _build_and_run("leave_ledger_test", sanitizer, "LEAVE_LEDGER_OK")
