"""The chunk layout of sharded_optimizer: which elements of a leaf each of N
workers owns. Worker r owns the flattened elements [r*c, (r+1)*c) of every
leaf, c = ceil(size / N), the last chunks padded with zeros to c.
sharded_optimizer, fully_sharded, their checks and their checkpoints share it;
it imports none of them."""

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


class BucketLayout:
    """A fusion bucket laid out worker by worker: row r of the (n, width)
    buffer holds every leaf's chunk r side by side (chunk_size each), padded
    at its end to a multiple of `align` elements."""

    def __init__(self, bucket, n: int, align: int):
        self.dtype = np.dtype(bucket.dtype)
        self.leaves = bucket.leaves
        self.shapes = None
        self.chunks = [chunk_size(s, n) for s in bucket.sizes]
        self.sizes = bucket.sizes
        used = sum(self.chunks)
        self.width = -(-used // align) * align
        self.n = n

    def pack(self, leaves) -> jax.Array:
        rows = [to_rows(x, self.n) for x in leaves]
        pad = self.width - sum(self.chunks)
        if pad:
            rows.append(jnp.zeros((self.n, pad), self.dtype))
        return jnp.concatenate(rows, axis=1).reshape(-1)

    def split(self, part) -> list:
        """This worker's row (its part of the buffer) as one array per leaf."""
        offsets = np.cumsum([0] + self.chunks)
        return [part[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def join(self, chunks) -> jax.Array:
        """Inverse of split: this worker's row from its leaves' chunks."""
        flat = [jnp.ravel(c) for c in chunks]
        pad = self.width - sum(self.chunks)
        if pad:
            flat.append(jnp.zeros((pad,), flat[0].dtype))
        return jnp.concatenate(flat) if len(flat) > 1 else flat[0]

    def unpack(self, buffer, n: int) -> list:
        """The whole buffer (n rows) -> each leaf's flat elements, unpadded."""
        rows = buffer.reshape(n, self.width)
        offsets = np.cumsum([0] + self.chunks)
        return [jnp.ravel(rows[:, a:b])[:size]
                for a, b, size in zip(offsets[:-1], offsets[1:], self.sizes)]
