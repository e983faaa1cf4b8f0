"""topk: top-k gradient sparsification with error feedback (Stich et al.,
"Sparsified SGD with Memory", NeurIPS 2018; Lin et al., "Deep Gradient
Compression", ICLR 2018) as an optax gradient transformation whose sparse
parts herring_jax reduces.

For each float32 leaf worth compressing, every worker adds its residual to
its gradient, keeps the k = ceil(fraction * size) entries of largest
magnitude, and keeps the rest as its next residual. The workers' (index,
value) pairs are gathered through one herring_jax reduction: each worker
writes its pairs into its own row of an (n, 2k) uint32 buffer, zeros
elsewhere, and the integer sum is that buffer with every row filled (exact
whatever the bits, as in herring_jax.broadcast). Every worker then adds the
rows into a zero gradient in worker order and divides by n, so the update
is bitwise the same on every worker, and a numpy model reproduces it.

Bytes on the wire per leaf: 2 n k words instead of size words (n workers):
a gain of 1 / (2 n fraction). It shrinks as workers are added, since the
sparse parts of different workers rarely share indices; a leaf whose gain
would fall below ``min_compression`` is averaged exactly instead. Other
leaves (non-float32, small) are averaged exactly in one reduction.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from herring_jax._src.process import runtime
from herring_jax._src.collectives.allreduce import allreduce
from herring_jax._src.transforms.powersgd import workers_mean
from herring_jax._src.transforms.optax_transform import step_weight
from herring_jax._src.collectives.psum import check_gradients, psum
from herring_jax._src.collectives.reduce_scatter import shard_index


class TopKState(NamedTuple):
    """Per leaf: this worker's error-feedback residual (the leaf's shape for
    leaves that may be sparsified, () for the others); and this process's
    index as data (int32), so that the step it writes its row in is the same
    program on every process (herring_jax checks that all processes run the
    same executables, and a rank folded in as a constant would differ)."""

    residual: Any
    process: Any


def topk_count(size: int, fraction: float) -> int:
    """k for a leaf of `size` elements: ceil(fraction * size), at least 1."""
    return max(1, math.ceil(fraction * size))


def sparsified(size: int, dtype, fraction: float, workers: int,
               min_compression: float) -> bool:
    """Whether a leaf is sent as its top-k: float32, and the gathered pairs
    (2 * workers * k words) at most 1 / min_compression of the leaf."""
    if np.dtype(dtype) != np.float32 or size == 0:
        return False
    return size >= min_compression * 2 * workers * topk_count(size, fraction)


def topk(fraction: float, axis_name=None, *, min_compression: float = 2.0,
         error_feedback: bool = True) -> optax.GradientTransformation:
    """Averages gradients across workers as the sum of each worker's top-k.

    Use it first in an ``optax.chain`` instead of ``allreduce_gradients``.

    Args:
      fraction: the share of each leaf's entries a worker sends, in (0, 1]
        (0.01 sends 1%: each pair is an index and a value).
      axis_name: None reduces across processes (one process per accelerator);
        a mesh axis name (or tuple) reduces over it inside ``jax.shard_map``
        (``check_vma=False``), as ``allreduce_gradients`` does.
      min_compression: a float32 leaf is sparsified only if the gathered
        pairs take at most 1 / min_compression of its bytes; others are
        averaged exactly.
      error_feedback: add what a worker did not send to its next gradient
        (without it top-k rarely converges).

    Returns:
      An ``optax.GradientTransformation`` whose state (``TopKState``) holds
      the residuals, checkpointable like any optimizer state.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if min_compression <= 0:
        raise ValueError(f"min_compression must be positive, got {min_compression}")

    def workers() -> int:
        if axis_name is None:
            return runtime.process_count()
        return int(jax.lax.axis_size(axis_name))

    def init_fn(params):
        # The number of workers is only known inside the step under
        # axis_name, so every leaf that one worker would sparsify keeps a
        # residual; with processes, the warning below says when none can.
        def residual(p):
            if error_feedback and sparsified(np.size(p), p.dtype, fraction, 1, min_compression):
                return jnp.zeros(np.shape(p), jnp.float32)
            return jnp.zeros((), jnp.float32)
        if axis_name is None:
            n = runtime.process_count()
            leaves = jax.tree_util.tree_leaves(params)
            if n > 1 and not any(sparsified(np.size(p), p.dtype, fraction, n, min_compression)
                                 for p in leaves):
                warnings.warn(
                    f"herring_jax.topk(fraction={fraction}): with {n} processes no leaf "
                    f"is worth sparsifying (the gathered pairs would take more than "
                    f"1/{min_compression} of its bytes), so every gradient is averaged "
                    "exactly; use a smaller fraction", stacklevel=2)
        # The rank is a value of the program, not a constant, under jit: every
        # process must compile the same program (reduce_scatter.shard_index).
        # Over a mesh axis the step takes the axis index instead: 0 here.
        process = shard_index() if axis_name is None else jnp.zeros((), jnp.int32)
        return TopKState(jax.tree_util.tree_map(residual, params), process)

    def gather(rows, process):
        """(2k,) uint32 of this worker -> (n, 2k) with every worker's row."""
        n = workers()
        me = process if axis_name is None else jax.lax.axis_index(axis_name)
        buf = jax.lax.dynamic_update_index_in_dim(
            jnp.zeros((n,) + rows.shape, rows.dtype), rows, me, 0)
        return allreduce(buf) if axis_name is None else psum(buf, axis_name)

    def mean(tree):
        return workers_mean(tree, axis_name)

    def update_fn(updates, state, params=None, **extra_args):
        # A weighted mean is not built in here: refuse the weight that
        # optax.chain would otherwise hand on to be dropped.
        step_weight(None, extra_args, "topk", supported=False)
        del params
        check_gradients(updates, axis_name, "topk")
        n = workers()
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        residuals = treedef.flatten_up_to(state.residual)
        which = [i for i, g in enumerate(leaves)
                 if sparsified(g.size, g.dtype, fraction, n, min_compression)]
        exact = [i for i in range(len(leaves)) if i not in which]
        out, new_residual = list(leaves), list(residuals)
        if exact:
            for i, r in zip(exact, mean([leaves[i] for i in exact])):
                out[i] = r
        if not which:
            return (jax.tree_util.tree_unflatten(treedef, out),
                    TopKState(jax.tree_util.tree_unflatten(treedef, new_residual),
                              state.process))
        pieces, ks = [], []
        for i in which:
            acc = leaves[i].reshape(-1)
            if error_feedback:
                acc = acc + residuals[i].reshape(-1)
            k = topk_count(acc.size, fraction)
            _, idx = jax.lax.top_k(jnp.abs(acc), k)
            values = acc[idx]
            if error_feedback:
                new_residual[i] = acc.at[idx].set(0.0).reshape(leaves[i].shape)
            pieces += [jax.lax.bitcast_convert_type(idx, jnp.uint32),
                       jax.lax.bitcast_convert_type(values, jnp.uint32)]
            ks.append(k)
        every = gather(jnp.concatenate(pieces), state.process)  # (n, sum of 2k)
        offset = 0
        for i, k in zip(which, ks):
            idx = jax.lax.bitcast_convert_type(every[:, offset:offset + k], jnp.int32)
            values = jax.lax.bitcast_convert_type(every[:, offset + k:offset + 2 * k],
                                                  jnp.float32)
            offset += 2 * k
            total = jnp.zeros(leaves[i].size, jnp.float32)
            for w in range(n):  # worker order: the same bits on every worker
                total = total.at[idx[w]].add(values[w], unique_indices=True)
            out[i] = (total / jnp.float32(n)).reshape(leaves[i].shape)
        return (jax.tree_util.tree_unflatten(treedef, out),
                TopKState(jax.tree_util.tree_unflatten(treedef, new_residual), state.process))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def model_np(grads: list[np.ndarray], residuals: list[np.ndarray], fraction: float):
    """numpy model of one leaf's step: grads[w] and residuals[w] of every
    worker (float32) -> (the update, every worker's new residual)."""
    n = len(grads)
    total = np.zeros(grads[0].size, np.float32)
    new_residuals = []
    for g, r in zip(grads, residuals):
        acc = (g.reshape(-1) + r.reshape(-1)).astype(np.float32)
        k = topk_count(acc.size, fraction)
        idx = np.argsort(-np.abs(acc), kind="stable")[:k]
        total[idx] += acc[idx]
        rest = acc.copy()
        rest[idx] = 0
        new_residuals.append(rest.reshape(g.shape))
    return (total / np.float32(n)).reshape(grads[0].shape), new_residuals
