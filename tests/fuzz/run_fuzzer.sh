#!/usr/bin/env bash
# Builds the wire-header fuzzer (tests/fuzz/header_fuzzer.cc + the parser,
# xla_ffi/engine/wire.cc, and the reduction kernels that divide by what the
# headers count) with libFuzzer, ASan and UBSan, and runs it for a
# fixed number of inputs from a fixed seed.
#
#   bash tests/fuzz/run_fuzzer.sh [RUNS] [BUILD_DIR]
#
# RUNS defaults to 1000000, BUILD_DIR to /tmp/herring_fuzz (the binary, the
# fuzzer's log and any crash-* input land there). Installs clang and its
# sanitizer/libFuzzer runtime with apt-get when missing (Debian 12, as root).
# Exits non-zero on any crash or sanitizer report; on success the last line is
#   FUZZ_DONE runs=<inputs executed> crashes=0
set -euo pipefail
cd "$(dirname "$0")/../.."

runs="${1:-1000000}"
build_dir="${2:-/tmp/herring_fuzz}"
if ! [[ "$runs" =~ ^[0-9]+$ ]] || ((runs == 0)); then
  echo "usage: $0 [RUNS] [BUILD_DIR]  (RUNS a positive integer, not '$runs')" >&2
  exit 2
fi
mkdir -p "$build_dir"
build_dir="$(cd "$build_dir" && pwd)"

# --- toolchain --------------------------------------------------------------
# Debian's `clang` does not pull in the compiler-rt runtime (libclang_rt.fuzzer,
# .asan, .ubsan) when recommends are off: that is libclang-rt-<major>-dev.
# Whether it is there is decided by linking a trivial fuzzer, not by paths.
apt_updated=0
apt_install() {
  if ((EUID != 0)); then
    echo "FUZZ_FAILED: need to apt-get install $*, but not running as root" >&2
    exit 1
  fi
  if ((!apt_updated)); then
    apt-get update -qq
    apt_updated=1
  fi
  echo "== apt-get install $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

fuzzer_links() {
  local probe="$build_dir/probe"
  printf '%s\n' '#include <cstddef>' '#include <cstdint>' \
    'extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }' \
    >"$probe.cc"
  clang++ -fsanitize=fuzzer,address,undefined "$probe.cc" -o "$probe" >/dev/null 2>&1
}

if ! command -v clang++ >/dev/null; then
  apt_install clang
fi
if ! fuzzer_links; then
  major="$(clang++ -dumpversion | cut -d. -f1)"
  apt_install "libclang-rt-${major}-dev"
  if ! fuzzer_links; then
    echo "FUZZ_FAILED: clang++ $(clang++ -dumpversion) cannot link -fsanitize=fuzzer,address,undefined" >&2
    exit 1
  fi
fi

# --- build ------------------------------------------------------------------
bin="$build_dir/header_fuzzer"
echo "== building $bin ($(clang++ --version | head -n1))"
clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -Wall -Wextra -I xla_ffi \
  tests/fuzz/header_fuzzer.cc xla_ffi/engine/wire.cc xla_ffi/engine/reduce_kernels.cc -o "$bin"

# --- run --------------------------------------------------------------------
# No corpus directory: every run starts from the same empty corpus and seed,
# so a run is reproducible. Inputs: a path selector, some 100 bytes of
# decisions and expected values, 104 header bytes; 320 leaves room for all, and
# -len_control=0 lets inputs reach that length at once (short runs in CI).
log="$build_dir/fuzz.log"
rm -f "$build_dir"/crash-* "$build_dir"/leak-* "$build_dir"/timeout-* "$build_dir"/oom-*
echo "== fuzzing: $runs inputs (log: $log)"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
start=$SECONDS
rc=0
"$bin" -runs="$runs" -seed=1 -max_len=320 -len_control=0 -timeout=10 -print_final_stats=1 \
  -artifact_prefix="$build_dir/" >"$log" 2>&1 || rc=$?
elapsed=$((SECONDS - start))

done_runs="$(sed -n 's/^Done \([0-9][0-9]*\) runs.*/\1/p' "$log" | tail -n1)"
if ((rc != 0)) || [[ -z "$done_runs" ]] ||
  grep -qE 'ERROR: (Address|Leak|Undefined)Sanitizer|runtime error:|deadly signal' "$log"; then
  tail -n 80 "$log" >&2
  echo "FUZZ_FAILED rc=$rc after ${elapsed}s; crashing inputs:" \
    "$(ls "$build_dir"/crash-* "$build_dir"/leak-* "$build_dir"/timeout-* "$build_dir"/oom-* 2>/dev/null | tr '\n' ' ')" >&2
  exit 1
fi

# The final coverage line, the statistics and the run count.
grep -E '^#[0-9]+[[:space:]]+DONE|^stat::|^Done ' "$log"
echo "fuzzing took ${elapsed}s"
echo "FUZZ_DONE runs=$done_runs crashes=0"
