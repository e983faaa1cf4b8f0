#!/usr/bin/env bash
# Prepares the GPU check (tests/gpu/run.sh) here, on the CPU machine, where
# the network is: the GPU machine has no network, no libfabric and 15 minutes
# of device time, none of which should go to installing or debugging a build.
# Lays into .gpu/ (ignored by git; the device call carries it):
#   debian/       Debian 12's libfabric 1.17 with the libraries it loads, fi_info
#                 and fi_pingpong, and libfabric-dev + pkgconf for a rebuild
#                 there; unpacked with dpkg -x, used through LD_LIBRARY_PATH
#   ext/          _herring_ffi for the GPU machine's Python 3.12, built against
#                 jaxlib 0.11.2's FFI headers and a CUDA 13.0 toolkit unpacked
#                 from NVIDIA's pip wheels
#   MANIFEST.txt  what is in it, and the hash of the xla_ffi/ sources it was
#                 built from (run.sh rebuilds there when the tree's differ)
# Downloads, the Python 3.12 scratch environment and the build tree stay in
# build/gpu-prepare/ (never carried); a second run reuses them.
#
# Needs: Debian 12 on amd64 (apt-get download then gives the very packages
# named in the issue; root, for `apt-get update` when the lists are empty),
# a Python 3.12 with its headers (PYTHON312, else python3.12 on PATH, else
# pyenv's), cmake and a C++17 compiler, and the package registries.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/common.sh

# What the GPU machine runs: Python 3.12 with jax and jaxlib 0.11.2 (and the
# jax-cuda13 plugin), nvcc 13, probably Ubuntu 24.04.
JAX_VERSION=0.11.2
CUDA_WHEELS=(nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 nvidia-cuda-nvcc==13.0.88)
# libfabric1's dependencies, closed over (libfabric-bin: fi_info, fi_pingpong).
RUNTIME_DEBS=(libfabric1 libfabric-bin ibverbs-providers libibverbs1 librdmacm1
              libpsm-infinipath1 libpsm2-2 libnl-3-200 libnl-route-3-200 libnuma1 libatomic1
              libuuid1)
# For building there if the prebuilt module does not load (no pkg-config there?).
BUILD_DEBS=(libfabric-dev pkgconf pkgconf-bin libpkgconf3)
# The glibc of Ubuntu 24.04, which the GPU machine probably runs.
MAX_GLIBC=2.39
# What the device call carries in all: the working tree and .gpu/.
CARRY_LIMIT_MIB=64

cache=build/gpu-prepare
t0=$SECONDS
die() { echo "prepare.sh: error: $*" >&2; exit 1; }

# -- checks ------------------------------------------------------------------
# shellcheck disable=SC1091
. /etc/os-release
[ "${VERSION_CODENAME:-}" = bookworm ] ||
  die "this is ${PRETTY_NAME:-an unknown system}; run it on Debian 12 (bookworm), whose " \
      "packages apt-get download fetches (the project's CPU machines are Debian 12)"
[ "$(dpkg --print-architecture)" = amd64 ] || die "the GPU machine is amd64; so must this be"
python312=
# The first that runs (pyenv's shim is on PATH even where it has no 3.12 to run).
for candidate in ${PYTHON312:-} python3.12 $(ls -d ~/.pyenv/versions/3.12*/bin/python3.12 \
    2>/dev/null | sort -rV); do
  if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    python312=$candidate
    break
  fi
done
[ -n "$python312" ] ||
  die "no Python 3.12 found: set PYTHON312=/path/to/python3.12 (with its headers)"
"$python312" -c 'import sysconfig, os, sys
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' ||
  die "$python312 has no headers (Python.h): install its -dev package"
command -v cmake >/dev/null || die "cmake is missing (pip install cmake, or apt-get install cmake)"
mkdir -p "$cache"

# -- Debian packages -----------------------------------------------------------
echo "== Debian 12 packages: ${RUNTIME_DEBS[*]} ${BUILD_DEBS[*]}"
mkdir -p "$cache/debs"
fetch_debs() {
  # apt-get warns when its _apt user cannot write here; that is harmless.
  (cd "$cache/debs" && apt-get download -q "$@" 2>&1 | grep -v "unsandboxed as root" || true)
}
missing=()
for p in "${RUNTIME_DEBS[@]}" "${BUILD_DEBS[@]}"; do
  compgen -G "$cache/debs/${p}_*.deb" >/dev/null || missing+=("$p")
done
if ((${#missing[@]})); then
  fetch_debs "${missing[@]}"
  still=()
  for p in "${missing[@]}"; do
    compgen -G "$cache/debs/${p}_*.deb" >/dev/null || still+=("$p")
  done
  if ((${#still[@]})); then
    echo "   (apt-get download missed ${still[*]}: apt-get update, then again)"
    apt-get update -qq || die "apt-get update failed: run as root with the Debian mirror reachable"
    fetch_debs "${still[@]}"
  fi
fi
for p in "${RUNTIME_DEBS[@]}" "${BUILD_DEBS[@]}"; do
  compgen -G "$cache/debs/${p}_*.deb" >/dev/null || die "apt-get download $p failed (see above)"
done

rm -rf "$GPU_PAYLOAD" && mkdir -p "$GPU_DEBIAN" "$GPU_EXT"
for deb in "$cache"/debs/*.deb; do
  dpkg -x "$deb" "$GPU_DEBIAN"
done
# Not needed there: documentation; the static library (the build links the
# shared one); rsocket's preload; libibverbs' device drivers and their
# /etc/libibverbs.d list, which libibverbs reads from / only (so the carried
# copies could never load: herring uses tcp there).
rm -rf "$GPU_DEBIAN"/usr/share/{doc,man,lintian,aclocal} "$GPU_DEBIAN/etc/libibverbs.d" \
  "$GPU_DEBIAN"/usr/lib/x86_64-linux-gnu/{libfabric.a,rsocket,libibverbs}
# What dpkg's alternatives would have made on installing libpsm-infinipath1.
ln -sf ../libpsm1/libpsm_infinipath.so.1.16 \
  "$GPU_DEBIAN/usr/lib/x86_64-linux-gnu/libpsm_infinipath.so.1"
[ -e "$GPU_DEBIAN/usr/lib/x86_64-linux-gnu/libpsm_infinipath.so.1" ] ||
  die "libpsm-infinipath1 changed its layout: fix the libpsm_infinipath.so.1 link in prepare.sh"

# -- CUDA 13.0 toolkit from pip wheels -------------------------------------------
cuda=$cache/cuda/nvidia/cu13
if [ ! -x "$cuda/bin/nvcc" ]; then
  echo "== pip download ${CUDA_WHEELS[*]}"
  rm -rf "$cache/cuda" && mkdir -p "$cache/cuda/whl"
  python3 -m pip download -q --disable-pip-version-check --no-deps -d "$cache/cuda/whl" \
    "${CUDA_WHEELS[@]}" 2>&1 | grep -v "^WARNING: " || true
  for w in "${CUDA_WHEELS[@]}"; do
    name=${w%%==*}
    compgen -G "$cache/cuda/whl/${name//-/_}-*.whl" >/dev/null || die "pip download $w failed"
  done
  for w in "$cache"/cuda/whl/*.whl; do
    python3 -P -m zipfile -e "$w" "$cache/cuda"
  done
  chmod +x "$cuda"/bin/* "$cuda"/bin/crt/* 2>/dev/null || true  # zip keeps no modes
  # CMake's FindCUDAToolkit looks for lib/libcudart.so, which the wheel leaves
  # out, and (CMake 4) lists include/cccl, which only the cccl wheel fills: the
  # handlers use the runtime API alone, so an empty folder will do.
  ln -sf libcudart.so.13 "$cuda/lib/libcudart.so"
  mkdir -p "$cuda/include/cccl"
fi
"$cuda/bin/nvcc" --version | tail -1

# -- Python 3.12 with jax/jaxlib 0.11.2 -----------------------------------------
# For jax.ffi.include_dir() (the FFI headers the GPU machine's jaxlib was
# built with) and nanobind; optax, flax and pytest too, so that the prepared
# module can be loaded here with the GPU machine's versions (the last check).
py=$cache/py312/bin/python
want="jax==$JAX_VERSION jaxlib==$JAX_VERSION nanobind optax flax ml_dtypes"
if [ "$(cat "$cache/py312/.installed" 2>/dev/null)" != "$want" ]; then
  echo "== Python 3.12 scratch environment: $want"
  rm -rf "$cache/py312"
  "$python312" -m venv "$cache/py312"
  # shellcheck disable=SC2086
  "$py" -m pip install -q --disable-pip-version-check $want 2>&1 | grep -v "^WARNING: " || true
  "$py" -c "import jax, jaxlib, nanobind, optax, flax
versions = jax.__version__, jaxlib.__version__
assert versions == ('$JAX_VERSION',) * 2, versions" ||
    die "pip install $want into $cache/py312 failed (see above)"
  echo "$want" >"$cache/py312/.installed"
fi

# -- the extension -----------------------------------------------------------------
echo "== building _herring_ffi for Python 3.12 + jaxlib $JAX_VERSION + CUDA 13.0" \
     "(log: $cache/build312.log)"
rm -rf "$cache/build312"  # no stale CMake cache from another toolkit or Python
if ! FABRIC_PREFIX=$GPU_DEBIAN REQUIRE_CUDA=1 bash tests/gpu/build_ext.sh "$py" \
    "$cache/build312" "$GPU_EXT" "$PWD/$cuda" >"$cache/build312.log" 2>&1; then
  tail -40 "$cache/build312.log" >&2
  die "the build failed (full log: $cache/build312.log)"
fi
ext=$(ls "$GPU_EXT"/_herring_ffi.cpython-312-*.so)

# -- what the GPU machine will load --------------------------------------------------
echo "== checking the payload against a glibc $MAX_GLIBC system without libfabric"
lib_dirs=$(gpu_debian_lib_dirs "$GPU_DEBIAN")
elves=("$ext" "$GPU_DEBIAN"/usr/bin/{fi_info,fi_pingpong,pkgconf})
while IFS= read -r -d '' f; do elves+=("$f"); done < <(
  find "$GPU_DEBIAN" -name '*.so*' -type f -print0)
newest=2.0
for f in "${elves[@]}"; do
  # Every library it needs resolves inside the payload or is a base library.
  while read -r name _ path _; do
    [ -z "$name" ] && continue
    if [ "$path" = "not" ]; then die "$f needs $name, which nothing carried provides"; fi
    case "$path" in "$PWD/$GPU_PAYLOAD"/*|"$GPU_PAYLOAD"/*) continue ;; esac
    [[ " ${GPU_BASE_LIBS[*]} " == *" $name "* ]] ||
      die "$f needs $name from this machine ($path), which the GPU machine may lack:" \
          "add its package"
  done < <(LD_LIBRARY_PATH=$lib_dirs ldd "$f" 2>/dev/null | grep "=>" || true)
  v=$(objdump -T "$f" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -1)
  [ -n "$v" ] && newest=$(printf '%s\n%s\n' "$newest" "$v" | sort -V | tail -1)
done
[ "$(printf '%s\n%s\n' "$newest" "$MAX_GLIBC" | sort -V | tail -1)" = "$MAX_GLIBC" ] ||
  die "the payload needs GLIBC_$newest, newer than the GPU machine's $MAX_GLIBC"
if readelf -d "$ext" | grep -q "libcudart"; then
  die "$ext links libcudart dynamically; it must be static (CMakeLists.txt: CUDA::cudart_static)"
fi
if readelf -d "$ext" | grep -qE "RPATH|RUNPATH"; then
  die "$ext has an RPATH naming this machine's folders (build_ext.sh: CMAKE_SKIP_BUILD_RPATH)"
fi
echo "   every library resolves inside .gpu/ or is glibc/libstdc++; newest glibc symbol: $newest"

# The module loads with the GPU machine's Python minor and jax, the carried
# libfabric (not this machine's) and the CUDA handlers built in.
site=$cache/site
rm -rf "$site" && mkdir -p "$site"
cp -r herring_jax "$site/" && cp "$ext" "$site/herring_jax/"
JAX_PLATFORMS=cpu LD_LIBRARY_PATH=$lib_dirs PYTHONPATH=$site "$py" -P -c "
import herring_jax, herring_jax._herring_ffi as m
from herring_jax._src.process import runtime
assert herring_jax.__file__.startswith('$PWD/$site'), herring_jax.__file__
assert runtime.cuda_handler_built(), 'no CUDA handlers in the module'
fabric = [l.split()[-1] for l in open('/proc/self/maps') if 'libfabric.so' in l]
assert fabric and all('/$GPU_PAYLOAD/' in p for p in fabric), fabric
print('   loads under Python 3.12 + jax', __import__('jax').__version__, 'with', fabric[0])
" || die "the prepared module does not load with the carried libraries (see above)"

# -- manifest and size -----------------------------------------------------------------
{
  echo "Prepared by tests/gpu/prepare.sh on $(date -u +%FT%TZ) ($PRETTY_NAME)."
  echo "sources: $(gpu_sources_hash)"
  echo "extension: ${ext#"$GPU_EXT"/} (Python 3.12, jaxlib $JAX_VERSION headers," \
       "CUDA 13.0 static runtime)"
  echo "cuda wheels: ${CUDA_WHEELS[*]}"
  echo "newest glibc symbol: $newest"
  echo "debian packages:"
  for deb in "$cache"/debs/*.deb; do
    echo "  $(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version)"
  done
} >"$GPU_PAYLOAD/MANIFEST.txt"

payload=$(du -sb "$GPU_PAYLOAD" | cut -f1)
tree=$( (git ls-files -z -co --exclude-standard 2>/dev/null || true) |
        xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "== .gpu/ is $(mib "$payload") MiB; with the working tree ($(mib "$tree") MiB)" \
     "$(mib $((payload + tree))) MiB of the device call's $CARRY_LIMIT_MIB MiB;" \
     "prepared in $((SECONDS - t0)) s"
((payload + tree < (CARRY_LIMIT_MIB - 8) * 1048576)) ||
  die "the payload and the tree leave less than 8 MiB of the $CARRY_LIMIT_MIB MiB" \
      "the device call carries"
echo "== ready: on a GPU machine, bash tests/gpu/run.sh (docs/guides/gpus.md, \"Running the GPU check\")"
