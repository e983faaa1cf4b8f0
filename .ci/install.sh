#!/usr/bin/env bash
# Installs everything herring_jax needs on a fresh Debian 12 machine (as root),
# then builds and installs herring_jax itself. Safe to run again: it installs
# only what is missing, and rebuilds the package.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_pkgs=()
pkg-config --exists libfabric 2>/dev/null || apt_pkgs+=(libfabric-dev)
command -v pkg-config >/dev/null || apt_pkgs+=(pkg-config)
command -v fi_info >/dev/null || apt_pkgs+=(libfabric-bin)
command -v ip >/dev/null || apt_pkgs+=(iproute2)
# Open MPI: the mpi4py and mpi4jax peers of `herring-jax bench`.
command -v mpirun >/dev/null || apt_pkgs+=(openmpi-bin libopenmpi-dev)
# clang with libFuzzer and the sanitizers' runtime (tests/fuzz); the runtime
# is only a recommendation of clang's, so it is named.
command -v clang++ >/dev/null || apt_pkgs+=(clang)
dpkg -s libclang-rt-14-dev >/dev/null 2>&1 || apt_pkgs+=(libclang-rt-14-dev)
if ((${#apt_pkgs[@]})); then
  echo "== apt-get install ${apt_pkgs[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null
fi

# pip with its "WARNING: " lines filtered out (running as root, ...) and
# pip's own exit status: a failed install must stop the script, or the
# suite would go on to test whatever stale build is installed. grep exits 1
# when it filtered every line, which is no failure. (The && / || pair reads
# PIPESTATUS before errexit could end the script on the failed pipeline.)
pip_install() {
  local -a status
  python3 -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: " \
    && status=("${PIPESTATUS[@]}") || status=("${PIPESTATUS[@]}")
  if ((status[0] != 0)); then
    echo "install.sh: error: pip install $* failed (exit ${status[0]}); see pip's output above" >&2
    return "${status[0]}"
  fi
  if ((status[1] > 1)); then
    echo "install.sh: error: grep failed (exit ${status[1]}) filtering pip's output" >&2
    return "${status[1]}"
  fi
}

echo "== pip install build and test dependencies"
pip_install "jax>=0.10,<0.11" "jaxlib>=0.10,<0.11" "nanobind>=2" "scikit-build-core>=0.10" \
  flax optax orbax-checkpoint ml_dtypes scikit-learn pytest pytest-timeout

echo "== pip install the benchmark's peers (mpi4py, mpi4jax, torch) and matplotlib"
# torch 2.13.0 is the CPU build these machines hold locally; mpi4jax builds
# against the installed mpi4py and jax. It also builds a CUDA bridge whenever
# nvcc is on PATH, which fails without CUDA's headers: an empty CUDA_ROOT
# turns that part off.
pip_install mpi4py "torch==2.13.0" matplotlib cython
if ! python3 -c "import mpi4jax" 2>/dev/null; then
  no_cuda=$(mktemp -d)
  status=0
  CUDA_ROOT=$no_cuda CUDA_PATH=$no_cuda pip_install --no-build-isolation mpi4jax || status=$?
  rmdir "$no_cuda"
  ((status == 0)) || exit "$status"
fi

echo "== building herring_jax (CMake via scikit-build-core)"
pip_install --no-build-isolation .
python3 -P -c "import herring_jax, herring_jax._herring_ffi; print('herring_jax', herring_jax.__version__, 'installed')"
