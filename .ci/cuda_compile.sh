#!/usr/bin/env bash
# Compiles herring_jax's XLA:CUDA handlers (xla_ffi/cuda_handlers.cc, the
# device layer's CUDA implementation device_cuda.cc, and the logic they share
# with the CPU double, device_handlers.cc and device_pending.cc, with
# scatter_gather.cc, where the reduce-scatter's and all-gather's blocks and
# the group's size that sizes their staging are, shared with XLA:CPU) against
# CUDA 12's runtime headers, with every warning an
# error, without a GPU or a CUDA toolkit. (The package build compiles them
# against the machine's toolkit when it has one, CUDA 13 on this project's CI
# machine; jax's cuda12 plugin users build against CUDA 12.) The headers come from
# NVIDIA's pip wheels (nvidia-cuda-runtime-cu12 for cuda_runtime_api.h,
# nvidia-cuda-nvcc-cu12 for the crt/ headers it includes), downloaded once into
# build/cuda_headers/ and unpacked there; nothing is installed.
#
# This keeps the CUDA path compiling; whether it runs correctly on a GPU is
# not checked here (see docs/guides/gpus.md).
set -euo pipefail
cd "$(dirname "$0")/.."

dir=build/cuda_headers
wheels=(nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86)
if [ ! -f "$dir/.unpacked" ]; then
  echo "== pip download ${wheels[*]} (headers only)"
  rm -rf "$dir" && mkdir -p "$dir/whl"
  python3 -m pip download -q --disable-pip-version-check --no-deps -d "$dir/whl" \
    "${wheels[@]}" 2>&1 | grep -v "^WARNING: " || true
  for w in "$dir"/whl/*.whl; do
    python3 -P -m zipfile -e "$w" "$dir/unpacked"
  done
  touch "$dir/.unpacked"
fi
runtime_inc="$dir/unpacked/nvidia/cuda_runtime/include"
crt_inc="$dir/unpacked/nvidia/cuda_nvcc/include"
for f in "$runtime_inc/cuda_runtime_api.h" "$crt_inc/crt/host_defines.h"; do
  if [ ! -f "$f" ]; then
    echo "cuda_compile.sh: error: $f is missing after unpacking ${wheels[*]}" >&2
    exit 1
  fi
done

xla_inc=$(python3 -P -c 'import jax.ffi; print(jax.ffi.include_dir())')
cxx=${CXX:-g++}
for src in xla_ffi/cuda_handlers.cc xla_ffi/device_cuda.cc xla_ffi/device_handlers.cc \
           xla_ffi/device_pending.cc xla_ffi/scatter_gather.cc; do
  echo "== $cxx -fsyntax-only $src"
  "$cxx" -std=c++17 -fsyntax-only -Wall -Wextra -Werror -DHERRING_WITH_CUDA \
    -Ixla_ffi -isystem "$xla_inc" -isystem "$runtime_inc" -isystem "$crt_inc" "$src"
done
echo "== the CUDA handlers compile"
