#!/usr/bin/env bash
# The GPU check: verifies herring_jax's XLA:CUDA path (cuda_handlers.cc,
# device_handlers.cc and device_cuda.cc, the start/done lowering; the logic
# alone also runs on CPU against the CPU double, tests/test_device_double.py)
# in one device call on a lent GPU
# machine, which has no network and no libfabric. Prepare first, here:
#   bash tests/gpu/prepare.sh      # fills .gpu/, which the device call carries
# then, from the repository root there (docs/guides/gpus.md, "Running the GPU check"):
#   bash tests/gpu/run.sh [STEP ...]    # default: every step, in order
# Dry run on a CPU machine (every step on CPU devices; only what needs CUDA
# is skipped, and said so; no .gpu/ needed):
#   JAX_PLATFORMS=cpu bash tests/gpu/run.sh
#
# Each step runs under its own `timeout -k`, all of them within
# GPU_CHECK_BUDGET_S (default 480: the device call allows 600 per command);
# a step that would not fit is skipped, so the summary always comes back. Logs
# go to $OUT (the device call returns that folder; default build/gpu-out):
# summary.txt, steps.log (each step's log tail) and logs.tar.gz (full logs,
# the compiled step's HLO, the engine's timeline). The summary, one line per
# step, is printed last. Exit status: 0 if no step failed.
#
# Environment: GPU_CHECK_PYTHON (default /opt/torch/.venv/bin/python where it
# exists, else python3); GPU_CHECK_BUILD=1 builds the extension here even if
# the prebuilt one loads; GPU_CHECK_PAYLOAD (default .gpu) is the prepared
# folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/common.sh
GPU_PAYLOAD=${GPU_CHECK_PAYLOAD:-$GPU_PAYLOAD}
[[ $GPU_PAYLOAD == /* ]] || GPU_PAYLOAD=$PWD/$GPU_PAYLOAD
GPU_DEBIAN=$GPU_PAYLOAD/debian GPU_EXT=$GPU_PAYLOAD/ext

ALL_STEPS=(preflight extension one-process reduce-memory reduce-transport mean-in-place
           identity identity-extra-launch flax-step overlap halves sharded-flax halves-timing
           restart failures)
# Each step's own limit in seconds (its usual time on the GPU is well below).
declare -A LIMIT=([preflight]=90 [extension]=360 [one-process]=120 [reduce-memory]=180
                  [reduce-transport]=200 [mean-in-place]=150 [identity]=150
                  [identity-extra-launch]=90 [flax-step]=200 [overlap]=30 [halves]=200
                  [sharded-flax]=200 [halves-timing]=150 [restart]=240 [failures]=200)
# Steps that have not yet run on a GPU (tests/gpu/halves_checks.py,
# restart_checks.py): their summary lines say "[new]", so that a reader knows
# what this run verified first.
NEW_STEPS=" halves sharded-flax halves-timing restart "
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
# GPU_CHECK_TIME_SCALE=K multiplies every step's limit (and restart_checks.py's
# launch timeouts): the CPU dry run on a slow 2-core machine, beside the rest
# of the suite, took 232 s for the restart step whose limit is 240 (an AMD
# EPYC that runs the suite 1.7x slower than the machines the limits were set
# on, 2026-11-29). A whole number; 1 on the GPU.
TIME_SCALE=${GPU_CHECK_TIME_SCALE:-1}
[[ $TIME_SCALE =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: GPU_CHECK_TIME_SCALE must be a whole number >= 1, not '$TIME_SCALE'" >&2; exit 2; }
for s in "${!LIMIT[@]}"; do LIMIT[$s]=$((LIMIT[$s] * TIME_SCALE)); done
export GPU_CHECK_TIME_SCALE=$TIME_SCALE
for s in "$@"; do
  [ -n "${LIMIT[$s]:-}" ] || { echo "run.sh: unknown step $s; steps: ${ALL_STEPS[*]}" >&2; exit 2; }
done
# The steps asked for, in their order, with the extension step wherever a
# later one needs the module it puts in place.
steps=()
for s in "${ALL_STEPS[@]}"; do
  if (($# == 0)) || [[ " $* " == *" $s "* ]] ||
     { [ "$s" = extension ] && [ "$*" != preflight ]; }; then
    steps+=("$s")
  fi
done

platform=${JAX_PLATFORMS:-cuda}
platform=${platform%%,*}
export JAX_PLATFORMS=$platform
if [ "$platform" = cpu ]; then mode="CPU dry run"; else mode="GPU ($platform)"; fi
python=${GPU_CHECK_PYTHON:-}
if [ -z "$python" ]; then
  python=python3
  [ -x /opt/torch/.venv/bin/python ] && python=/opt/torch/.venv/bin/python
fi
# Absolute, but not through its symlink: a venv's python must stay the venv's.
case $python in
  /*) ;;
  */*) python=$PWD/$python ;;
  *) python=$(command -v "$python") || { echo "run.sh: no $python on PATH" >&2; exit 2; } ;;
esac
# cmake, ninja (pip-installed beside that Python) and nvcc for a rebuild.
PATH=$(dirname "$python"):$PATH
[ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null && PATH=$PATH:/usr/local/cuda/bin
export PATH
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/herring-gpu-check.XXXXXX")
export GPU_CHECK_WORK=$work
mkdir -p "$work/logs"
: >"$OUT/steps.log"
start_s=$SECONDS

# A start whose done never pairs must not hold the device call: the done gives
# up after HERRING_TIMEOUT_S + this (default 300 s).
export HERRING_CUDA_DONE_GRACE_S=${HERRING_CUDA_DONE_GRACE_S:-30}
export HERRING_TIMEOUT_S=${HERRING_TIMEOUT_S:-60}
# No process here may take most of the GPU up front (two ranks share it).
export XLA_PYTHON_CLIENT_PREALLOCATE=false

cat <<EOF
== herring_jax GPU check: $mode, python $python, $(date -u +%FT%TZ)
== logs: $OUT (work: $work)
== Expected first-run problems, and what to look at:
  1. XLA:GPU may schedule every start right next to its done: no overlap, results
     still right. See "overlap": the schedule map (S start, D done, kN kernels) and
     the timeline. A WARN there is this, not a wrong result.
  2. The host stage (HERRING_HOST_STAGE=1, "reduce-memory") reads the other
     process's staging buffers, pinned with cudaHostAlloc, with process_vm_readv:
     unverified. If only reduce-memory fails, suspect this ("reduce-transport" runs
     with the host stage off).
  3. Run ids through the PJRT plugin: reductions are matched across processes by
     XLA's run id; if the CUDA plugin gives each process another one, every
     two-process step times out after HERRING_TIMEOUT_S naming two different
     runs while "one-process" passes.
  4. Exit-time crashes with herring threads inside CUDA calls: the workers report
     their results before shutdown, so such a step is a WARN (results right, exit
     code apart), not a FAIL.
  5. The [new] steps have never run on a GPU. If "halves" fails while the all-reduce
     steps pass, suspect the results' staging: a reduce-scatter's result is 1/G of its
     operand, an all-gather's G times it (device_handlers.cc sizes it from the group).
     "halves-timing"'s lax peer may fail at once: NCCL refuses two ranks on one GPU;
     herring's times are still reported, with NCCL's error.
  6. "sharded-flax" compares programs compiled apart: XLA:CUDA may choose other
     kernels for the gradient in each (as in flax-step's first run). A FAIL there with
     tiny differences while "halves" passes is that, not the reduction.
  7. "restart" [new] trains examples/train_lm.py twice on 2 ranks (once killed and
     restarted): with fully_sharded where orbax is missing, so a FAIL there while
     "sharded-flax" fails too is the halves, not the restart.
EOF

# -- the carried libraries -----------------------------------------------------
# Only those this machine lacks, so that an older Debian copy of a common
# library (libuuid, libatomic, libnuma) never shadows the system's.
if [ -d "$GPU_DEBIAN" ]; then
  export GPU_CHECK_CARRIED=$GPU_DEBIAN
  mkdir -p "$work/lib"
  system_libs=$( (ldconfig -p 2>/dev/null || true) | awk '{print $1}')
  IFS=: read -ra dirs <<<"$(gpu_debian_lib_dirs "$GPU_DEBIAN")"
  linked=()
  for d in "${dirs[@]}"; do
    for f in "$d"/*.so.*; do
      [ -e "$f" ] || continue
      name=$(basename "$f")
      if ! grep -qxF "$name" <<<"$system_libs"; then
        ln -sf "$f" "$work/lib/$name"
        # Report the names the loader asks for (libfabric.so.1), not the files.
        [[ $name =~ \.so\.[0-9]+$ ]] && linked+=("$name")
      fi
    done
  done
  export LD_LIBRARY_PATH=$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$PATH:$GPU_DEBIAN/usr/bin  # fi_info where the system has none
  echo "== carried libraries this machine lacks: ${linked[*]:-none}"
else
  echo "== no $GPU_PAYLOAD/ (tests/gpu/prepare.sh makes it): the system's libfabric and herring_jax"
fi

# -- steps ---------------------------------------------------------------------
declare -a SUMMARY=()
failed=0
stop_reason=
record() {  # step status seconds text
  local line text=$4
  [[ $NEW_STEPS == *" $1 "* ]] && text="[new] $text"
  line=$(printf '%-5s %-22s %6ss  %s' "$2" "$1" "$3" "$text")
  SUMMARY+=("$line")
  last_text=$4
  echo "$line"
  printf '%s\n' "${SUMMARY[@]}" >"$OUT/summary.txt"
  [ "$2" = FAIL ] && failed=1
  return 0
}
# Runs "$@" as step $1's command under timeout; records its summary line.
run_step() {
  local step=$1 log=$work/logs/$(printf '%02d' "${#SUMMARY[@]}")-$1.log; shift
  local left=$((BUDGET_S - (SECONDS - start_s) - 10)) limit=${LIMIT[$step]} t0=$SECONDS rc=0
  if [ -n "$stop_reason" ]; then record "$step" SKIP 0 "$stop_reason"; return 0; fi
  if ((left < 20)); then
    record "$step" SKIP 0 "out of time (GPU_CHECK_BUDGET_S=$BUDGET_S)"
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "== $step (limit ${limit}s)"
  timeout -k 10 "$limit" "$@" >"$log" 2>&1 || rc=$?
  local took=$((SECONDS - t0)) line status text
  line=$(grep "^GPU_CHECK_SUMMARY " "$log" | tail -1 || true)
  if ((rc == 124 || rc == 137)); then
    status=FAIL text="timed out after ${limit}s"
  elif [ -n "$line" ]; then
    read -r _ status text <<<"$line"
  elif ((rc == 0)); then
    status=PASS text="done"
  else
    status=FAIL text="exit $rc: $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-200)"
  fi
  { echo "==== $step: $status (${took}s, exit $rc)"; tail -n 120 "$log"; } >>"$OUT/steps.log"
  record "$step" "$status" "$took" "$text"
}

# Puts a herring_jax in place for the later steps: the prebuilt module beside
# the tree's Python package, else an installed herring_jax (the CPU dry run),
# else one built here. Prints how; fails if none imports.
extension_setup() {
  local suffix prebuilt site=$work/site want have
  suffix=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  prebuilt=$GPU_EXT/_herring_ffi$suffix
  rm -rf "$site" && mkdir -p "$site" && cp -r herring_jax "$site/"
  # -P: the tree's herring_jax (no module) must not shadow the one in $site.
  try_site() { PYTHONPATH=$site "$python" -P -c "import herring_jax._herring_ffi" 2>&1; }
  if [ "${GPU_CHECK_BUILD:-0}" != 1 ] && [ -f "$prebuilt" ]; then
    want=$(gpu_sources_hash)
    have=$(sed -n 's/^sources: //p' "$GPU_PAYLOAD/MANIFEST.txt" 2>/dev/null || true)
    if [ "$want" != "$have" ]; then
      echo "the prebuilt module is from other xla_ffi/ sources ($have, the tree's: $want): building"
    else
      cp "$prebuilt" "$site/herring_jax/"
      if try_site; then
        echo "EXTENSION=prebuilt $prebuilt"
        echo "PYTHONPATH=$site" >"$work/env"
        return 0
      fi
      echo "the prebuilt module does not load (above): building"
      rm -f "$site/herring_jax/_herring_ffi$suffix"
    fi
  elif [ "${GPU_CHECK_BUILD:-0}" != 1 ] &&
       (cd / && "$python" -P -c "import herring_jax._herring_ffi" 2>/dev/null); then
    echo "EXTENSION=installed" \
         "$(cd / && "$python" -P -c 'import herring_jax; print(herring_jax.__file__)')"
    : >"$work/env"
    return 0
  else
    echo "no prebuilt module for $suffix and no installed herring_jax: building"
  fi
  local cuda=0 fabric=
  [ "$platform" != cpu ] && cuda=1
  [ -d "$GPU_DEBIAN" ] && fabric=$GPU_DEBIAN  # else the system's libfabric-dev
  FABRIC_PREFIX=$fabric REQUIRE_CUDA=$cuda \
    bash tests/gpu/build_ext.sh "$python" "$work/build" "$site/herring_jax"
  try_site || { echo "the module built here does not import either"; return 1; }
  echo "EXTENSION=built here $(ls "$site"/herring_jax/_herring_ffi*.so)"
  echo "PYTHONPATH=$site" >"$work/env"
}

# The extension step runs in a child bash, under its own timeout like the others.
export -f extension_setup gpu_sources_hash
export python platform work GPU_EXT GPU_DEBIAN GPU_PAYLOAD
for step in "${steps[@]}"; do
  if [ "$step" = extension ]; then
    run_step extension bash -c 'set -euo pipefail; extension_setup
      set -a; . "$work/env"; set +a
      "$python" tests/gpu/checks.py extension'
    if [ -f "$work/env" ] && [ "${SUMMARY[-1]:0:4}" != FAIL ]; then
      how=$(grep -h "^EXTENSION=" "$work"/logs/*-extension.log | tail -1 | cut -d= -f2-)
      how=${how//$PWD\//}
      SUMMARY[-1]="${SUMMARY[-1]} [$how]"
      set -a; . "$work/env"; set +a
    else
      stop_reason=${stop_reason:-"no herring_jax module (see the extension step)"}
    fi
    continue
  fi
  run_step "$step" "$python" tests/gpu/checks.py "$step"
  if [ "$step" = preflight ] && [ "${SUMMARY[-1]:0:4}" = FAIL ] && [ "$platform" != cpu ]; then
    stop_reason="preflight failed: $last_text"
  fi
done

# -- results -------------------------------------------------------------------
tar -czf "$OUT/logs.tar.gz" -C "$work" logs 2>/dev/null || echo "(could not tar the logs)"
{
  echo "== herring_jax GPU check, $mode: $((SECONDS - start_s)) s; one line per step"
  printf '%s\n' "${SUMMARY[@]}"
} | tee "$OUT/summary.txt"
rm -rf "$work"
exit "$failed"
