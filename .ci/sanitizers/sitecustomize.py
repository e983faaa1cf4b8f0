"""Loaded by every Python process of a sanitizer job (.ci/sanitizers.sh puts
the assembled package directory, which holds this file, first on PYTHONPATH).

It makes sure no process silently tests the normal build: importing
herring_jax._herring_ffi from anywhere but the sanitized package directory
($HERRING_SANITIZER_PKG), or without the sanitizer's runtime in the process,
raises ImportError. Each process that did load the sanitized module leaves
a file named after its pid in $HERRING_SANITIZER_MARKS, which the script
counts afterwards.
"""

import os
import sys

_PKG = os.environ.get("HERRING_SANITIZER_PKG")
_MARKS = os.environ.get("HERRING_SANITIZER_MARKS")
# The runtime's library, GCC's or clang's name.
_RUNTIME = {"thread": ("libtsan.so", "libclang_rt.tsan-"),
            "address,undefined": ("libasan.so", "libclang_rt.asan-")}.get(
    os.environ.get("HERRING_SANITIZER", ""))
_MODULE = "herring_jax._herring_ffi"


class _SanitizedModuleOnly:
    """Meta path finder that vets where herring's extension comes from."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _MODULE:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(fullname, path)
        origin = os.path.realpath(spec.origin) if spec and spec.origin else None
        pkg = os.path.realpath(_PKG) + os.sep
        if origin is None or not origin.startswith(pkg):
            raise ImportError(f"sanitizer job: {_MODULE} would come from {origin}, not from "
                              f"the sanitized build in {pkg}")
        with open("/proc/self/maps") as maps:
            loaded = any(name in line for line in maps for name in _RUNTIME)
        if not loaded:
            raise ImportError(f"sanitizer job: no {' or '.join(_RUNTIME)} in this process "
                              f"(LD_PRELOAD={os.environ.get('LD_PRELOAD')!r})")
        if _MARKS:
            with open(os.path.join(_MARKS, str(os.getpid())), "w") as mark:
                mark.write(f"{origin} {' '.join(sys.argv)[:300]}\n")
        return spec


if _PKG and _RUNTIME:
    sys.meta_path.insert(0, _SanitizedModuleOnly())
