#!/usr/bin/env bash
# Builds herring_jax's extension with ThreadSanitizer, and separately with
# AddressSanitizer + UBSan, and runs short multi-process tests (allreduce,
# failing peers, faults injected into one process, a killed peer) with each.
# Any sanitizer report fails the job.
#
#   bash .ci/sanitizers.sh                 # both, as CI runs them (.ci/run)
#   bash .ci/sanitizers.sh thread          # one of: thread, address
#   bash .ci/sanitizers.sh thread -x -v    # further arguments go to pytest
#   bash .ci/sanitizers.sh address tests/test_x.py::test_y   # these tests instead
#
# Needs what .ci/install.sh installs (jax, nanobind, pytest, libfabric-dev,
# cmake, g++, clang++ and libclang-rt-14-dev; ninja if present). Nothing is
# installed: each build goes to build/sanitize-<name>/, and the tests import
# it from a package directory assembled there (build/sanitize-<name>/pkg: the
# sanitized _herring_ffi next to a copy of herring_jax/'s Python files), first
# on PYTHONPATH. About 9 min for both on a slow 2-core machine, 2 min of it the builds
# (seconds from ccache's entries: .ci/ccache.sh).
#
# Compilers: ThreadSanitizer with g++ (12), because clang 14's shared TSan
# runtime crashes while it loads into any program that links libstdc++ (its
# __cxa_atexit interceptor runs before the runtime is initialized), and a
# preloaded runtime is the only way into an uninstrumented Python; GCC's
# libtsan preloads fine. AddressSanitizer + UBSan with clang++ (14), the
# compiler of tests/test_cpp_units.py: its one runtime holds both, so UBSan's
# reports honour log_path like ASan's, whereas GCC's separate libubsan ignores
# log_path next to libasan and writes only to stderr, where a report from a
# process whose exit status no test checks could go unnoticed.
#
# Python, jaxlib and libfabric are not instrumented; the runtime is
# LD_PRELOADed into every process (the interpreter is run by its real path:
# pyenv's shim is a bash script, and bash crashes under libtsan).
# Reports go to build/sanitize-<name>/reports/; the job fails when any file
# appears there, whatever the tests concluded.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# The real interpreter, not a shim: everything below runs it directly.
py=$(python3 -P -c 'import sys; print(sys.executable)')

which_sanitizers=(thread address)
if (($# > 0)) && [[ $1 == thread || $1 == address ]]; then
  which_sanitizers=("$1")
  shift
fi
pytest_args=()
only=()
for arg in "$@"; do
  if [[ $arg == tests/* ]]; then only+=("$arg"); else pytest_args+=("$arg"); fi
done

# The short selection. Each test starts its own processes; the sanitizer
# runtime and the checks in .ci/sanitizers/sitecustomize.py reach them all
# through the environment, which the launcher (herring_jax/_src/launcher/launch.py)
# and the chaos test pass on unchanged.
tests=(
  # Allreduce, bitwise against numpy: 2 processes x 2 devices (both devices'
  # XLA threads meet in the local rendezvous) and 4 x 2, every dtype and op,
  # sizes up to 1 MiB in short mode; 50 reductions in one jit (concurrent
  # handlers); tcp;ofi_rxm with 256 KiB chunks (several per part) and shm.
  "tests/test_allreduce.py::test_every_dtype_op_and_size[2-2]"
  "tests/test_allreduce.py::test_fifty_reductions_in_one_jit"
  "tests/test_allreduce.py::test_provider_matrix[tcp;ofi_rxm-False]"
  "tests/test_allreduce.py::test_provider_matrix[shm-False]"
  # Failures: mismatched shapes (timeout), a dead peer (heartbeats), and a
  # peer that dies while the reductions inside a jitted step are in flight.
  "tests/test_failures.py::test_mismatched_shapes_fail_every_rank_within_the_timeout"
  "tests/test_failures.py::test_dead_peer_is_detected_by_heartbeats_long_before_the_timeout"
  "tests/test_failures.py::test_failure_inside_the_users_jit_raises_herring_error"
  # An abort that arrives before a reduction is visible to it; std::bad_alloc
  # once a batch is active (it must end as every failed batch does).
  "tests/test_failures.py::test_an_abort_that_arrives_before_a_reduction_is_visible_still_fails_it_at_once"
  "tests/test_failures.py::test_out_of_memory_once_a_reduction_is_under_way_fails_it_and_leaves_no_batch_behind"
  # Host stage: a call that fails after publishing its slice withdraws its
  # inputs (boards, two steps) while a slow peer still reads them; the same
  # on the direct path (every peer reads staged copies of whole inputs).
  "tests/test_host_stage.py::test_a_failed_call_withdraws_its_inputs_before_anyone_uses_a_slice_of_them[1-0]"
  "tests/test_host_stage.py::test_a_failed_call_withdraws_its_inputs_before_anyone_uses_a_slice_of_them[1-1]"
  # Engine: stale messages matched by posted receives (drop and re-post, the
  # re-post task outliving nothing), full-size strangers before an in-place
  # contribution leaves, and posts queued beyond the provider's.
  "tests/test_engine.py::test_stale_messages_are_dropped_and_the_sums_stay_exact"
  "tests/test_engine.py::test_strangers_before_the_contribution_leaves_cannot_change_an_in_place_sum[None]"
  "tests/test_engine.py::test_posts_beyond_the_providers_queues_wait_in_herrings_queue"
  # Messages forged to come from another rank: directed receives, source checks.
  "tests/test_engine.py::test_messages_forged_to_come_from_another_rank_are_never_taken_for_its_own"
  # Exits: a rank that leaves waits (the progress, watch and server threads
  # running) for the receipt of a peer stopped past its last reduction; a
  # rank that ran one reduction fewer fails the others through the counts.
  "tests/test_leave.py::test_an_exiting_rank_waits_for_a_stopped_peer_and_names_it"
  "tests/test_leave.py::test_a_rank_that_runs_one_reduction_fewer_fails_the_others_fast[transport]"
  # A fast exit that awaits the acknowledgment of an abort a (late) server
  # thread owes, sent from the exiting thread meanwhile.
  "tests/test_fast_exit.py::test_a_fast_exit_first_tells_the_others_a_failure_that_a_server_thread_owes"
  # Chaos: one of 4 processes SIGKILLed while they reduce (1 kill in short mode).
  "tests/test_chaos.py::test_killed_peer_fails_every_survivor_with_herring_error"
  # All-gathers on one host's boards, which read only the peers' result
  # slices (a posting never found must never be read).
  "tests/test_collectives.py::test_process_collectives_on_one_host_through_the_boards"
  # Server-only processes: the workers' parts summed on a server (served.cc),
  # bitwise against the same job without it; a killed server (rank 0 telling
  # the others from its watch thread, its server threads late or not); reduce-scatters
  # and all-gathers block by block through two servers.
  "tests/test_servers.py::test_two_workers_and_a_server_sum_bitwise_as_without_it"
  "tests/test_servers.py::test_a_killed_server_fails_every_worker_fast_naming_it"
  "tests/test_servers.py::test_reduce_scatter_and_allgather_through_the_servers_are_bitwise_as_without_them"
  # XLA:CUDA's handler code on the CPU double (its stream threads, events,
  # the done's wait on herring's thread): copies delayed each way; a failed
  # copy whose error sticks and whose process aborts the job.
  "tests/test_device_double.py::test_delayed_copies_on_the_double_still_give_the_right_sums"
  "tests/test_device_double.py::test_a_failed_copy_fails_its_rank_whose_abort_fails_the_other_at_once"
)
if ((${#only[@]})); then
  tests=("${only[@]}")
fi
# Every test above starts at least 2 processes that load the extension.
min_loaded=$((2 * ${#tests[@]}))

runtime_of() {  # the runtime libraries $cxx links, colon-separated, in order
  local lib path paths=()
  for lib in "$@"; do
    path=$("$cxx" -print-file-name="$lib")
    if [[ $path != /* || ! -f $path ]]; then
      echo "sanitizers.sh: error: $cxx has no $lib (install its sanitizer runtime)" >&2
      return 1
    fi
    paths+=("$path")
  done
  (IFS=:; echo "${paths[*]}")
}

source .ci/ccache.sh
status=0
for name in "${which_sanitizers[@]}"; do
  start=$(date +%s)
  build=build/sanitize-$name
  case $name in
    thread)
      flag=thread
      cxx=g++
      preload=$(runtime_of libtsan.so)
      ;;
    address)
      flag=address,undefined
      cxx=clang++
      preload=$(runtime_of libclang_rt.asan-x86_64.so)
      ;;
  esac
  echo "== [$name] building the extension with -fsanitize=$flag ($cxx) in $build"
  mkdir -p "$build"
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S xla_ffi -B "$build" "${generator[@]}" -DCMAKE_CXX_COMPILER="$cxx" \
    -DHERRING_SANITIZE="$flag" -DHERRING_CUDA=OFF -DPython_EXECUTABLE="$py" >"$build.cmake.log" 2>&1 \
    || { cat "$build.cmake.log"; exit 1; }
  cmake --build "$build" -j "${HERRING_SANITIZER_JOBS:-2}" >"$build.build.log" 2>&1 \
    || { tail -n 60 "$build.build.log"; exit 1; }
  so=$(find "$build" -maxdepth 1 -name '_herring_ffi*.so')
  [[ -n $so ]] || { echo "sanitizers.sh: error: no _herring_ffi*.so in $build" >&2; exit 1; }
  echo "== [$name] built in $(( $(date +%s) - start )) s"

  # The package directory: herring_jax's Python files (a copy, so that the
  # source tree never holds the sanitized module) and the sanitized module.
  pkg=$root/$build/pkg
  rm -rf "$pkg"
  mkdir -p "$pkg"
  cp -r herring_jax "$pkg/"
  find "$pkg" \( -name __pycache__ -o -name '*.so' \) -prune -exec rm -rf {} +
  cp "$so" "$pkg/herring_jax/"
  cp .ci/sanitizers/sitecustomize.py "$pkg/"
  reports=$root/$build/reports
  marks=$root/$build/loaded
  rm -rf "$reports" "$marks"
  mkdir -p "$reports" "$marks"

  # exitcode / halt_on_error: a report ends the process at once with a code
  # no test expects, and its log file fails the job below anyway.
  san_env=(
    "LD_PRELOAD=$preload"
    "PYTHONPATH=$pkg"
    "HERRING_SANITIZER=$flag"
    "HERRING_SANITIZER_PKG=$pkg"
    "HERRING_SANITIZER_MARKS=$marks"
  )
  if [[ $name == thread ]]; then
    # ignore_noninstrumented_modules: the memory accesses that uninstrumented
    # libraries (Python, jaxlib, libfabric, libstdc++) make through
    # intercepted calls (memcpy, free, new, ...) are not checked; their
    # pthread locking still counts. jaxlib orders its threads with absl's
    # futexes and atomics, which TSan cannot see, so checking those accesses
    # gave hundreds of false races per process (gRPC, protobuf, XLA), and
    # symbolizing them stalled the processes for seconds at a time. The
    # price: a race between herring's code and, say, libfabric copying one of
    # herring's buffers goes unseen. herring's own code is instrumented and
    # fully checked. (called_from_lib suppressions are no substitute: they
    # also drop the library's locking, and every mutex then looks broken.)
    san_env+=("TSAN_OPTIONS=halt_on_error=1 exitcode=66 ignore_noninstrumented_modules=1
second_deadlock_stack=1 log_path=$reports/tsan
suppressions=$root/.ci/sanitizers/tsan.supp ${HERRING_TSAN_OPTIONS:-}")
  else
    # detect_leaks=0: LeakSanitizer would report everything the uninstrumented
    # interpreter and jaxlib never free at exit, and the workers leave with
    # os._exit, which skips the leak check anyway. UBSan runs inside ASan's
    # runtime and shares its common flags (exitcode, log_path, suppressions):
    # UBSAN_OPTIONS, read last, repeats them. -fno-sanitize-recover (CMake):
    # the first UB ends the process.
    common="exitcode=86 log_path=$reports/asan-ubsan suppressions=$root/.ci/sanitizers/asan.supp"
    san_env+=("ASAN_OPTIONS=halt_on_error=1 detect_leaks=0 $common ${HERRING_ASAN_OPTIONS:-}")
    san_env+=("UBSAN_OPTIONS=halt_on_error=1 print_stacktrace=1 $common ${HERRING_UBSAN_OPTIONS:-}")
  fi

  echo "== [$name] ${#tests[@]} tests"
  test_status=0
  # Two tests at a time, as tests/run.sh: 216 s against 290 s one at a time
  # under ThreadSanitizer (2026-11-29, 2 cores); HERRING_SANITIZER_WORKERS=0
  # runs them one at a time.
  env "${san_env[@]//$'\n'/ }" "$py" -P -m pytest "${tests[@]}" -q -rfEs -p no:cacheprovider \
    -n "${HERRING_SANITIZER_WORKERS:-2}" --dist loadgroup \
    --durations=0 "${pytest_args[@]}" || test_status=$?

  loaded=$(find "$marks" -type f | wc -l)
  mapfile -t found < <(find "$reports" -type f | sort)
  if ((${#found[@]})); then
    echo "== [$name] FAILED: ${#found[@]} process(es) wrote sanitizer reports:"
    for f in "${found[@]}"; do
      echo "---- $f"
      cat "$f"
    done
    status=1
  elif ((test_status != 0)); then
    echo "== [$name] FAILED: pytest exited $test_status (no sanitizer report)"
    status=1
  elif ((loaded < min_loaded)); then
    echo "== [$name] FAILED: only $loaded processes loaded the sanitized extension (expected >= $min_loaded)"
    status=1
  else
    echo "== [$name] OK: 0 reports; $loaded processes ran the sanitized extension" \
      "($(( $(date +%s) - start )) s)"
  fi
done
exit "$status"
