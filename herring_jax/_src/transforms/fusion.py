"""Balanced fusion buffers: many gradient leaves packed into few flat buffers.

Leaves are grouped per dtype and visited in the order their gradients become
ready: inside jit, the order in which the traced program produces them (the
backward pass: last layers first); otherwise reversed pytree order. They fill
buffers of up to ``fusion_bytes``, the first buffer of each dtype only up to
``first_bucket_bytes`` (as PyTorch DDP does) so that the first reduction starts
as early as possible while backprop goes on; a leaf larger than a buffer gets a
buffer of its own. The engine then cuts every buffer into equal parts, one per
server, whatever the leaf sizes inside it. Bucket boundaries do not change the
result: every element is summed in the same (rank) order.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np


class Bucket(NamedTuple):
    dtype: np.dtype
    leaves: tuple[int, ...]   # indices into the flattened tree, in packing order
    sizes: tuple[int, ...]    # element counts of those leaves


def plan(leaves: Sequence, fusion_bytes: int, first_bucket_bytes: int | None = None,
         ready: Sequence[int] | None = None) -> list[Bucket]:
    """Groups leaf indices into buckets of one dtype and at most fusion_bytes.

    ``ready[i]`` is when leaf i becomes ready (smaller first); None means
    reversed pytree order. Buckets are returned in the order they become ready
    (when their last leaf does).
    Zero-size leaves are left out (there is nothing to reduce).

    Examples:
      >>> [b.leaves for b in plan([np.zeros(4, np.float32)] * 3, 32)]
      [(2, 1), (0,)]
      >>> [b.leaves for b in plan([np.zeros(4, np.float32)] * 3, 32, 16, ready=[5, 0, 9])]
      [(1,), (0, 2)]
    """
    if fusion_bytes <= 0:
        raise ValueError(f"fusion_bytes must be positive, got {fusion_bytes}")
    first_bucket_bytes = fusion_bytes if first_bucket_bytes is None else first_bucket_bytes
    if first_bucket_bytes <= 0:
        raise ValueError(f"first_bucket_bytes must be positive, got {first_bucket_bytes}")
    if ready is None:
        order = list(reversed(range(len(leaves))))
    else:
        # Ties (e.g. inputs) keep reversed pytree order.
        order = sorted(reversed(range(len(leaves))), key=lambda i: ready[i])
    position = {i: k for k, i in enumerate(order)}
    open_: dict[np.dtype, tuple[list[int], list[int], int]] = {}
    done: list[Bucket] = []
    started: set[np.dtype] = set()  # dtypes whose first bucket is closed

    def close(dtype):
        idx, sizes, _ = open_.pop(dtype)
        done.append(Bucket(dtype, tuple(idx), tuple(sizes)))
        started.add(dtype)

    for i in order:
        leaf = leaves[i]
        size = int(np.prod(leaf.shape, dtype=np.int64))
        if size == 0:
            continue
        dtype = np.dtype(leaf.dtype)
        nbytes = size * dtype.itemsize
        cap = fusion_bytes if dtype in started else first_bucket_bytes
        if dtype in open_ and open_[dtype][2] + nbytes > cap:
            close(dtype)
        if dtype not in open_:
            open_[dtype] = ([], [], 0)
        idx, sizes, used = open_[dtype]
        idx.append(i)
        sizes.append(size)
        open_[dtype] = (idx, sizes, used + nbytes)
    for dtype in list(open_):
        close(dtype)
    return sorted(done, key=lambda b: position[b.leaves[-1]])


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
