#!/usr/bin/env bash
# Builds herring_jax's extension module (_herring_ffi) with CMake for one
# Python, without pip, and copies it into OUT_DIR. prepare.sh prebuilds the GPU
# machine's here (Python 3.12, jaxlib 0.11.2's FFI headers, CUDA 13.0 from pip
# wheels); run.sh rebuilds it there when the prebuilt one is stale or does not
# load (that machine has no libfabric and no network, but nvcc, cmake and
# nanobind).
#
# Usage: build_ext.sh PYTHON BUILD_DIR OUT_DIR [CUDA_ROOT]
#   PYTHON     the interpreter the module is for; it must import jax and nanobind
#   BUILD_DIR  CMake's build tree (reused when run again)
#   OUT_DIR    where _herring_ffi*.so is copied
#   CUDA_ROOT  a CUDA toolkit (bin/nvcc, include/, lib/); default: CMake's search
# Environment:
#   FABRIC_PREFIX  a `dpkg -x` prefix holding libfabric-dev (and pkgconf, used
#                  when the machine has no pkg-config); default: the system's
#   REQUIRE_CUDA   1: fail unless the CUDA handlers were built
set -euo pipefail
cd "$(dirname "$0")/../.."
if (($# < 3)); then
  echo "usage: $0 PYTHON BUILD_DIR OUT_DIR [CUDA_ROOT]" >&2
  exit 2
fi
python=$1 build=$2 out=$3 cuda_root=${4:-}
mkdir -p "$build" "$out"
build=$(cd "$build" && pwd)
# CMake takes a relative interpreter path for a name to search for.
case "$python" in */*) python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python") ;; esac

# No build RPATH: it would name this machine's folders (and the current
# directory); the module finds libfabric through LD_LIBRARY_PATH (run.sh).
cmake_args=(-S xla_ffi -B "$build" -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$python"
            -DCMAKE_SKIP_BUILD_RPATH=ON)
if command -v ninja >/dev/null && [ ! -f "$build/CMakeCache.txt" ]; then
  cmake_args+=(-G Ninja)
fi
[ -n "$cuda_root" ] && cmake_args+=(-DCUDAToolkit_ROOT="$cuda_root")

if [ -n "${FABRIC_PREFIX:-}" ]; then
  prefix=$(cd "$FABRIC_PREFIX" && pwd)
  pc=$prefix/usr/lib/x86_64-linux-gnu/pkgconfig/libfabric.pc
  if [ ! -f "$pc" ]; then
    echo "build_ext.sh: error: $pc is missing: FABRIC_PREFIX must hold libfabric-dev " \
         "(run tests/gpu/prepare.sh)" >&2
    exit 1
  fi
  # The .pc names prefix=/usr; point it at the unpacked copy, and search only
  # there, so that a system libfabric cannot be picked up instead.
  mkdir -p "$build/pkgconfig"
  sed "s|^prefix=.*|prefix=$prefix/usr|" "$pc" >"$build/pkgconfig/libfabric.pc"
  export PKG_CONFIG_LIBDIR=$build/pkgconfig PKG_CONFIG_PATH=
  if ! command -v pkg-config >/dev/null; then
    # Debian's pkgconf, run from the prefix (its libpkgconf lies there too).
    mkdir -p "$build/bin"
    cat >"$build/bin/pkg-config" <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" \\
  exec "$prefix/usr/bin/pkgconf" "\$@"
EOF
    chmod +x "$build/bin/pkg-config"
    cmake_args+=(-DPKG_CONFIG_EXECUTABLE="$build/bin/pkg-config")
  fi
fi

echo "== cmake configure (python: $python${cuda_root:+, CUDA: $cuda_root})"
cmake "${cmake_args[@]}" | tee "$build/configure.log"
if [ "${REQUIRE_CUDA:-0}" = 1 ] && ! grep -q "CUDA handler enabled" "$build/configure.log"; then
  echo "build_ext.sh: error: CMake found no CUDA toolkit (see above); the GPU check needs " \
       "the CUDA handlers: pass CUDA_ROOT or put nvcc on PATH" >&2
  exit 1
fi
echo "== cmake build"
cmake --build "$build" --target _herring_ffi -j "$(nproc)"
suffix=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
cp "$build/_herring_ffi$suffix" "$out/"
echo "== built $out/_herring_ffi$suffix"
