#!/usr/bin/env bash
# Builds the Bazel targets of BUILD.bazel offline with Debian's bazel-bootstrap
# and checks that the extension it links imports. Needs jax and nanobind
# installed (.ci/install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v bazel >/dev/null || [ ! -d /usr/share/bazel/rules/java ] ||
   [ ! -d /usr/share/bazel/tools/platforms ]; then
  echo "== apt-get install bazel-bootstrap bazel-rules-java bazel-platforms"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap bazel-rules-java \
    bazel-platforms >/dev/null
fi

# External inputs, linked where WORKSPACE expects them.
local_dir=build/bazel_local
mkdir -p "$local_dir"
ln -sfn "$(python3 -P -c 'import jax.ffi; print(jax.ffi.include_dir())')" "$local_dir/xla_ffi_include"
ln -sfn "$(python3 -P -c 'import nanobind, os; print(os.path.dirname(nanobind.__file__))')" "$local_dir/nanobind"
ln -sfn "$(python3 -P -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" "$local_dir/python_include"

output_base=/tmp/herring_jax_bazel
# Bazel's disk cache keys each action on its inputs' digests and its command
# line (paths inside the workspace are relative), so a new clone rebuilds
# only what changed; HERRING_BAZEL_DISK_CACHE= (empty) turns it off.
disk_cache=${HERRING_BAZEL_DISK_CACHE-$HOME/.cache/herring_jax_bazel_disk}
cache_flags=()
[ -n "$disk_cache" ] && cache_flags=(--disk_cache="$disk_cache")
echo "== bazel build (output base $output_base${disk_cache:+, disk cache $disk_cache})"
start=$(date +%s)
# standalone: the linux-sandbox prints ~45 debug lines per action on this kernel.
bazel --output_base="$output_base" build --symlink_prefix=/ --spawn_strategy=standalone \
  "${cache_flags[@]}" //:herring_engine //:herring_handlers //:_herring_ffi.so
so="$(bazel --output_base="$output_base" info --symlink_prefix=/ bazel-bin 2>/dev/null)/_herring_ffi.so"
echo "== built in $(( $(date +%s) - start )) s: $so"

# The Bazel-built extension must load and expose its handler.
python3 -P - "$so" <<'PY'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_herring_ffi", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
names = sorted(module.registrations())
assert names == ["herring_allreduce", "herring_async_done", "herring_async_known", "herring_async_start",
                 "herring_double_allreduce_done", "herring_double_allreduce_start",
                 "herring_join", "herring_simulated_compute"], names
print("bazel-built _herring_ffi.so imports; handlers:", names)
PY
# Do not leave the Bazel server holding memory on a 2-core CI machine.
bazel --output_base="$output_base" shutdown
