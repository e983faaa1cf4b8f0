#!/usr/bin/env bash
# Installs what herring_jax needs for one purpose on a fresh Debian 12 machine
# (as root), then builds and installs herring_jax itself. Safe to run again:
# it installs only what is missing, and rebuilds the package.
#
#   bash .ci/install.sh demo    # the library and the training demo
#                               # (examples/run_demo.sh): libfabric, jax,
#                               # flax, optax, scikit-learn's digits, matplotlib
#   bash .ci/install.sh tests   # + what the test command needs
#                               # (tests/run.sh): pytest, clang and its
#                               # sanitizer runtime, Open MPI's mpirun,
#                               # orbax-checkpoint, the docs' Sphinx
#   bash .ci/install.sh all     # + the benchmark's peers (mpi4py, mpi4jax,
#                               # torch), for the suite's extended part and
#                               # `herring-jax bench` (the default)
set -euo pipefail
cd "$(dirname "$0")/.."

purpose=${1:-all}
case "$purpose" in
  demo) level=1 ;;
  tests) level=2 ;;
  all) level=3 ;;
  *)
    echo "install.sh: error: unknown purpose '$purpose'; use demo, tests or all" >&2
    exit 2 ;;
esac

apt_pkgs=()
pkg-config --exists libfabric 2>/dev/null || apt_pkgs+=(libfabric-dev)
command -v pkg-config >/dev/null || apt_pkgs+=(pkg-config)
command -v fi_info >/dev/null || apt_pkgs+=(libfabric-bin)
# ip: the simulated hosts (network namespaces) of the tests and the bench.
command -v ip >/dev/null || apt_pkgs+=(iproute2)
if ((level >= 2)); then
  # Open MPI: tests/test_recipes.py launches through mpirun; the mpi4py and
  # mpi4jax peers of `herring-jax bench` build against it.
  command -v mpirun >/dev/null || apt_pkgs+=(openmpi-bin libopenmpi-dev)
  # clang with libFuzzer and the sanitizers' runtime (tests/fuzz, the C++
  # units); the runtime is only a recommendation of clang's, so it is named.
  command -v clang++ >/dev/null || apt_pkgs+=(clang)
  dpkg -s libclang-rt-14-dev >/dev/null 2>&1 || apt_pkgs+=(libclang-rt-14-dev)
  # ccache: CI builds the C++ several ways from a new clone (.ci/ccache.sh).
  command -v ccache >/dev/null || apt_pkgs+=(ccache)
fi
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

# The jax that matches the interpreter (python3: a venv's when it comes
# first on PATH, as in .ci/run's second leg). Python 3.11 gets jax 0.10, the
# newest release for it and the setup tested longest; 3.12 and later get the
# newest jax herring_jax supports (jax_compat.SUPPORTED_JAX: >=0.10,<0.13).
py_version=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case "$py_version" in
  3.11) jax_spec=">=0.10,<0.11" ;;
  3.1[2-9]) jax_spec=">=0.12,<0.13" ;;
  *)
    echo "install.sh: error: python3 is Python $py_version; herring_jax needs Python 3.11" \
      "(jax 0.10) or 3.12 and later (jax 0.12): put one first on PATH, e.g. in a venv" >&2
    exit 1 ;;
esac

# The library and the demo: jax (whose jaxlib has the XLA FFI headers),
# nanobind and scikit-build-core to build, flax and optax, scikit-learn's
# digits and matplotlib for the demo's data and plot. setuptools: mpi4jax
# builds without build isolation below, and a venv of Python 3.12 or later
# comes without it.
deps=("jax$jax_spec" "jaxlib$jax_spec" "nanobind>=2" "scikit-build-core>=0.10" setuptools
      flax optax ml_dtypes scikit-learn matplotlib)
what="the library and the demo"
if ((level >= 2)); then
  # The tests: pytest (pytest-xdist runs two tests at a time), orbax-checkpoint (examples/train_lm.py's checkpoints),
  # and sphinx, myst-parser and sphinx-book-theme, which build docs/ (bash
  # docs/build.sh, tests/test_docs.py); docutils stays at 0.19 or older
  # because this machine's awscli (from pip) requires it and pip would
  # upgrade it from under awscli; Sphinx 7.3 and myst-parser 4 are the newest
  # that work with it.
  deps+=(pytest pytest-timeout pytest-xdist orbax-checkpoint sphinx myst-parser sphinx-book-theme
         "docutils<=0.19")
  what="the library, the demo and the tests"
fi
echo "== pip install what $what need (Python $py_version: jax$jax_spec)"
pip_install "${deps[@]}"

if ((level >= 3)); then
  echo "== pip install the benchmark's peers (mpi4py, mpi4jax, torch)"
  # torch 2.13.0 is the CPU build these machines hold locally, for Python 3.11
  # only; for 3.12 the registry serves CUDA builds of several GB, so there the
  # bench's torch_gloo peer reports itself missing (as on any machine without
  # torch) unless torch is already installed. mpi4jax builds against the
  # installed mpi4py and jax. It also builds a CUDA bridge whenever nvcc is on
  # PATH, which fails without CUDA's headers: an empty CUDA_ROOT turns that
  # part off.
  peers=(mpi4py cython)
  [ "$py_version" = 3.11 ] && peers+=("torch==2.13.0")
  pip_install "${peers[@]}"
  if ! python3 -c "import mpi4jax" 2>/dev/null; then
    no_cuda=$(mktemp -d)
    status=0
    CUDA_ROOT=$no_cuda CUDA_PATH=$no_cuda pip_install --no-build-isolation mpi4jax || status=$?
    rmdir "$no_cuda"
    ((status == 0)) || exit "$status"
  fi
fi

echo "== building herring_jax (CMake via scikit-build-core)"
source .ci/ccache.sh
pip_install --no-build-isolation .
python3 -P -c "import herring_jax, herring_jax._herring_ffi; print('herring_jax', herring_jax.__version__, 'installed')"
