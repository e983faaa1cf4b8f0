# Sourced (not run) by the scripts that compile herring_jax's C++: routes
# CMake's compiles through ccache when it is installed (.ci/install.sh
# installs it for the tests), so that a rebuild of unchanged sources is a
# lookup. CI builds the extension five ways in one run (the package, the
# Python 3.12 venv's, ThreadSanitizer's, AddressSanitizer's, the C++ units)
# from a new clone each time: without a cache about 6 min of its 2 cores
# (measured: `pip install .` 56 s from scratch, 9 s from ccache in another
# clone). The cache keys on the preprocessed source and the compiler's
# options, so a changed file or flag compiles again; nothing stale is used.
#
# CCACHE_BASEDIR: paths inside this checkout become relative, so a clone
# elsewhere hits the same entries (the build directories are inside it:
# build/...). CCACHE_NOHASHDIR: the -g builds' working directory is not part
# of the key. A launcher or base directory set by the caller is kept;
# HERRING_CCACHE=0 turns it off.
if [ "${HERRING_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER:-ccache}
  export CMAKE_C_COMPILER_LAUNCHER=${CMAKE_C_COMPILER_LAUNCHER:-ccache}
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
  export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
fi
