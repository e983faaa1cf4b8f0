"""The files of save_sharded's checkpoints: writing a process's own file
whole and in place (never a shared one, never through a memory map), and
reading the element ranges of a leaf back, from the current format and from
version 1's.

Why one file per process: on NFS a written page goes back to the server
whole, and on object-store (FUSE) mounts a writer uploads its whole view of a
file, so processes on different hosts writing neighbouring ranges of one file
overwrite each other's bytes with stale copies, silently.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Callable

import jax.numpy as jnp
import numpy as np

from herring_jax._src.transforms.chunks import chunk_range, chunk_size


def file_dtype(name: str) -> np.dtype:
    """What a file holds for dtype `name`: the dtype itself, or for the
    dtypes numpy cannot name in a file (bfloat16, ...) unsigned integers of
    their width, the bits (the manifest says which dtype to view them as)."""
    dtype = np.dtype(jnp.dtype(name))
    if dtype.kind in "biufc":
        return dtype
    return np.dtype(f"u{dtype.itemsize}")


def as_file_dtype(values: np.ndarray) -> np.ndarray:
    """`values` as file_dtype holds them (bfloat16 and friends: their bits)."""
    want = file_dtype(values.dtype.name)
    return values if values.dtype == want else values.view(want)


def write_whole(path: str, write: Callable) -> int:
    """Writes the file at `path` by `write(f)` into a name of its own, flushes
    it to the device and renames it into place: `path` is whole or absent.
    Returns its bytes."""
    partial = path + ".partial"
    with open(partial, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    os.replace(partial, path)
    sync_directory(os.path.dirname(path))
    return size


def write_shard(path: str, members: dict[str, Callable[[], np.ndarray]]) -> int:
    """One process's file: an uncompressed .npz (numpy.load reads it), as
    numpy.savez writes one, each member's array made (copied to the host)
    only as it is written, so that one leaf at a time is held twice."""
    def write(f):
        with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED,
                             allowZip64=True) as z:
            for name, make in members.items():
                with z.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, make(), allow_pickle=False)
    return write_whole(path, write)


def write_json(path: str, value) -> int:
    return write_whole(path, lambda f: f.write(json.dumps(value, indent=1).encode()))


def sync_directory(path: str) -> None:
    """Makes the names created in directory `path` durable (a rename is an
    entry of the directory, not of the file)."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (FUSE mounts among them) cannot sync a directory
    finally:
        os.close(fd)


class Shards:
    """Reads a checkpoint in the current format: each process's file holds
    its chunk of every chunked leaf (flattened, unpadded), and process 0's
    also the leaves the same on every process. A process opens only the
    files whose chunks overlap the range it asks for."""

    def __init__(self, directory: str, manifest: dict):
        self.directory = directory
        self.manifest = manifest
        self.processes = manifest["processes"]
        self._files: dict[int, object] = {}

    def _file(self, w: int):
        if w not in self._files:
            entry = self.manifest["files"][w]
            path = os.path.join(self.directory, entry["name"])
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"{path} is missing: the checkpoint {self.directory} was damaged after it "
                    "was written (its manifest names the file of every process that saved "
                    "it)") from None
            if size != entry["bytes"]:
                raise ValueError(f"{path} has {size} bytes where the manifest says "
                                 f"{entry['bytes']}: the file was truncated or replaced")
            self._files[w] = np.load(path)
        return self._files[w]

    def _member(self, w: int, name: str, elements: int | None) -> np.ndarray:
        try:
            data = self._file(w)[name]
        except KeyError:
            raise ValueError(f"{self.manifest['files'][w]['name']} in {self.directory} lacks "
                             f"{name}: the file is damaged") from None
        if elements is not None and data.size != elements:
            raise ValueError(f"{name} in {self.manifest['files'][w]['name']} of "
                             f"{self.directory} holds {data.size} elements, not {elements}")
        return data

    def range(self, entry: dict, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of a chunked leaf, flattened, in file_dtype."""
        size = int(np.prod(entry["shape"], dtype=np.int64))
        out = np.empty(hi - lo, file_dtype(entry["dtype"]))
        if hi <= lo:
            return out
        c = chunk_size(size, self.processes)
        for w in range(lo // c, (hi - 1) // c + 1):
            a, b = chunk_range(size, self.processes, w)
            part = np.ravel(self._member(w, entry["member"], b - a))
            s, e = max(a, lo), min(b, hi)
            out[s - lo:e - lo] = part[s - a:e - a]
        return out

    def whole(self, entry: dict) -> np.ndarray:
        """A leaf, whole and flattened, in file_dtype."""
        if not entry["chunked"]:
            return np.ravel(self._member(0, entry["member"], None))
        size = int(np.prod(entry["shape"], dtype=np.int64))
        return self.range(entry, 0, size)

    def residual(self, rank: int, k: int) -> np.ndarray:
        return self._member(rank, f"residual_{k}", None)

    def close(self) -> None:
        for f in self._files.values():
            f.close()


class Version1:
    """Reads a checkpoint of version 1: one whole .npy per leaf, written by
    every process through memory maps (unsafe on shared file systems; still
    read, read-only)."""

    def __init__(self, directory: str, manifest: dict):
        """Adds to `manifest`'s entries what the current format's say."""
        self.directory = directory
        self.processes = manifest["processes"]
        for k, e in enumerate(manifest["state"]):
            e.update(file=os.path.join("state", f"{k}.npy"), chunked=e["param"] is not None)
        for i, e in enumerate(manifest["params"]):
            e.update(file=os.path.join("params", f"{i}.npy"), chunked=True)

    def _flat(self, entry: dict) -> np.ndarray:
        return np.ravel(np.load(os.path.join(self.directory, entry["file"]), mmap_mode="r"))

    def range(self, entry: dict, lo: int, hi: int) -> np.ndarray:
        return np.array(self._flat(entry)[lo:hi])

    def whole(self, entry: dict) -> np.ndarray:
        return np.array(self._flat(entry))

    def residual(self, rank: int, k: int) -> np.ndarray:
        return np.load(os.path.join(self.directory, "residual", str(rank), f"{k}.npy"))

    def close(self) -> None:
        pass
