"""Records what this process writes to files while a block runs: every path
it opens for writing (builtins.open / io.open, os.open), every path it
renames a file onto, and every memory map it maps writable. The checkpoint
tests assert from it that no two processes write one file."""

from __future__ import annotations

import builtins
import contextlib
import io
import mmap
import os

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _path(file) -> str | None:
    if isinstance(file, (str, bytes, os.PathLike)):
        return os.path.abspath(os.fsdecode(file))
    return None  # a file descriptor: its os.open was recorded


@contextlib.contextmanager
def recording():
    """Yields {"writes": [paths], "maps": [paths]}, filled while the block runs."""
    seen = {"writes": [], "maps": []}
    real_open, real_os_open = builtins.open, os.open
    real_replace, real_rename, real_mmap = os.replace, os.rename, mmap.mmap

    def open_(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and _path(file):
            seen["writes"].append(_path(file))
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if flags & _WRITE_FLAGS:
            seen["writes"].append(_path(path))
        return real_os_open(path, flags, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        seen["writes"].append(_path(dst))
        return real_replace(src, dst, *args, **kwargs)

    def rename(src, dst, *args, **kwargs):
        seen["writes"].append(_path(dst))
        return real_rename(src, dst, *args, **kwargs)

    class Mmap(real_mmap):
        def __new__(cls, fileno, length, *args, **kwargs):
            access = kwargs.get("access", mmap.ACCESS_DEFAULT)
            if access in (mmap.ACCESS_WRITE, mmap.ACCESS_DEFAULT):
                seen["maps"].append(os.readlink(f"/proc/self/fd/{fileno}"))
            return super().__new__(cls, fileno, length, *args, **kwargs)

    builtins.open = io.open = open_
    os.open, os.replace, os.rename, mmap.mmap = os_open, replace, rename, Mmap
    try:
        yield seen
    finally:
        builtins.open = io.open = real_open
        os.open, os.replace, os.rename, mmap.mmap = real_os_open, real_replace, real_rename, \
            real_mmap
