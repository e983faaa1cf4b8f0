"""Balanced fusion buffers: many gradient leaves packed into few flat buffers.

Leaves are grouped per dtype and visited in backward order (last parameters
first: their gradients are ready first in backprop), filling buffers up to
``fusion_bytes``; a leaf larger than that gets a buffer of its own. The engine
then cuts every buffer into equal parts, one per server, whatever the leaf
sizes inside it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np


class Bucket(NamedTuple):
    dtype: np.dtype
    leaves: tuple[int, ...]   # indices into the flattened tree, in packing order
    sizes: tuple[int, ...]    # element counts of those leaves


def plan(leaves: Sequence, fusion_bytes: int) -> list[Bucket]:
    """Groups leaf indices into buckets of one dtype and at most fusion_bytes.

    Zero-size leaves are left out (there is nothing to reduce).

    Examples:
      >>> [b.leaves for b in plan([np.zeros(4, np.float32)] * 3, 32)]
      [(2, 1), (0,)]
    """
    if fusion_bytes <= 0:
        raise ValueError(f"fusion_bytes must be positive, got {fusion_bytes}")
    open_: dict[np.dtype, tuple[list[int], list[int], int]] = {}
    done: list[tuple[int, Bucket]] = []  # (first leaf's backward position, bucket)
    first: dict[np.dtype, int] = {}

    def close(dtype):
        idx, sizes, _ = open_.pop(dtype)
        done.append((first.pop(dtype), Bucket(dtype, tuple(idx), tuple(sizes))))

    for pos, i in enumerate(reversed(range(len(leaves)))):
        leaf = leaves[i]
        size = int(np.prod(leaf.shape, dtype=np.int64))
        if size == 0:
            continue
        dtype = np.dtype(leaf.dtype)
        nbytes = size * dtype.itemsize
        if dtype in open_ and open_[dtype][2] + nbytes > fusion_bytes:
            close(dtype)
        if dtype not in open_:
            open_[dtype] = ([], [], 0)
            first[dtype] = pos
        idx, sizes, used = open_[dtype]
        idx.append(i)
        sizes.append(size)
        open_[dtype] = (idx, sizes, used + nbytes)
    for dtype in list(open_):
        close(dtype)
    return [b for _, b in sorted(done, key=lambda t: t[0])]


def pack(leaves: Sequence, buckets: Sequence[Bucket]) -> list:
    """One flat array per bucket."""
    return [jnp.concatenate([jnp.ravel(leaves[i]) for i in b.leaves]) if len(b.leaves) > 1
            else jnp.ravel(leaves[b.leaves[0]]) for b in buckets]


def unpack(buffers: Sequence, buckets: Sequence[Bucket], leaves: Sequence) -> list:
    """Inverse of pack: the leaves, with reduced values where a bucket had them."""
    out = list(leaves)
    for buf, b in zip(buffers, buckets):
        offsets = np.cumsum((0,) + b.sizes)
        for i, start, stop in zip(b.leaves, offsets[:-1], offsets[1:]):
            out[i] = buf[start:stop].reshape(leaves[i].shape)
    return out
