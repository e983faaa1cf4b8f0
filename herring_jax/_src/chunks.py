"""The chunk layout of sharded_optimizer: which elements of a leaf each of N
workers owns. Worker r owns the flattened elements [r*c, (r+1)*c) of every
leaf, c = ceil(size / N), the last chunks padded with zeros to c.
sharded_optimizer, its checks and its checkpoints share it; it imports none
of them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def chunk_size(size: int, n: int) -> int:
    """Elements of each worker's chunk of a leaf of `size` elements."""
    return -(-size // n) if size else 0


def chunk_shape(shape: tuple, n: int) -> tuple:
    """The shape the inner transformation sees a leaf's chunk in: its
    c = chunk_size elements on the last axis, the leaf's other axes kept as 1
    (so ``x.ndim``, which weight-decay masks often test, is unchanged; a
    scalar's chunk has one axis)."""
    c = chunk_size(int(np.prod(shape, dtype=np.int64)), n)
    return (1,) * (len(shape) - 1) + (c,)


def to_rows(x, n: int):
    """Leaf x as (n, c): row r is worker r's chunk, zero-padded."""
    flat = jnp.ravel(x)
    c = chunk_size(flat.size, n)
    return jnp.pad(flat, (0, n * c - flat.size)).reshape(n, c)


def chunk_of(x, n: int, r):
    """Worker r's chunk of leaf x (r may be traced), in chunk_shape."""
    rows = to_rows(x, n)
    return jax.lax.dynamic_index_in_dim(rows, r, 0, keepdims=False).reshape(
        chunk_shape(np.shape(x), n))


def from_rows(rows, shape):
    """Inverse of to_rows: the leaf of `shape` from its (n, c) rows."""
    size = int(np.prod(shape, dtype=np.int64))
    return jnp.ravel(rows)[:size].reshape(shape)


def chunk_range(size: int, n: int, r: int) -> tuple[int, int]:
    """Worker r's elements [lo, hi) of a flattened leaf of `size` elements,
    without the padding (empty for the last workers of a small leaf)."""
    c = chunk_size(size, n)
    return min(size, r * c), min(size, (r + 1) * c)
