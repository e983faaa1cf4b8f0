# Shared by prepare.sh and run.sh (sourced, not run): where the prepared
# payload lies and how both sides tell whether a prebuilt extension is the one
# the tree's sources would build.

# The payload prepare.sh lays out and the device call carries (ignored by git).
GPU_PAYLOAD=.gpu
# Inside it: Debian 12's libfabric and the libraries it loads, unpacked with
# dpkg -x (a prefix, never installed), and the prebuilt extension.
GPU_DEBIAN=$GPU_PAYLOAD/debian
GPU_EXT=$GPU_PAYLOAD/ext

# A hash of the C++ sources the extension is built from (xla_ffi/, without the
# Bazel files), from the files themselves: the GPU machine gets the working
# tree without .git. A prebuilt extension whose hash differs from the tree's is
# stale, and run.sh rebuilds it there.
gpu_sources_hash() {
  find xla_ffi -path xla_ffi/bazel -prune -o -type f \
    \( -name '*.cc' -o -name '*.h' -o -name CMakeLists.txt \) -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}

# The library folders of the Debian prefix (libnl-3 lies under lib/, the
# others under usr/lib/).
gpu_debian_lib_dirs() {
  local prefix=$1
  echo "$prefix/usr/lib/x86_64-linux-gnu:$prefix/lib/x86_64-linux-gnu"
}

# Libraries a glibc 2.39 system (Ubuntu 24.04) is sure to have: a carried
# library may need these and nothing else from outside the prefix.
GPU_BASE_LIBS=(linux-vdso.so.1 libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1
               ld-linux-x86-64.so.2 libstdc++.so.6 libgcc_s.so.1)
