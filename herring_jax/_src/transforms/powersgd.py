"""powersgd: low-rank gradient compression (Vogels et al., "PowerSGD: Practical
Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019) as
an optax gradient transformation whose small factors herring_jax reduces.

For each gradient leaf of two or more dimensions that is worth compressing,
viewed as a matrix M (its leading axes by the rest, split where the matrix is
closest to square), one power-iteration step:

  P = M Q            reduced (mean) across workers
  P^ = orthonormal columns of P (QR)
  Q = M^T P^         reduced (mean) across workers
  update = P^ Q^T    the same on every worker

Q is kept for the next step (warm start), and with error feedback each worker
keeps M - update and adds it to its next gradient, as PyTorch's PowerSGD
communication hook does. Other leaves (biases, norms, small matrices) are
averaged exactly in one reduction. The bytes on the wire per matrix are
(rows + cols) * rank floats instead of rows * cols, times the power iterations.

The factors can cross in a wire codec (``codec="bf16"``: half their bytes).
Error feedback then carries Q's rounding too, since the update is made of the
Q every worker received; P's rounding only moves the subspace a little.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from herring_jax._src.collectives import codecs
from herring_jax._src.collectives.allreduce import allreduce
from herring_jax._src.transforms.optax_transform import step_weight
from herring_jax._src.collectives.psum import check_gradients, pmean


class PowerSGDState(NamedTuple):
    """Per leaf: the warm-start factor Q (cols x rank; () for leaves reduced
    exactly) and the error-feedback residual (the leaf's shape; ()); and the
    number of updates so far (int32, counted up to the end of the exact
    warm-up)."""

    q: Any
    residual: Any
    count: Any = None


def _matrix_shape(shape) -> tuple[int, int]:
    """The matrix a leaf is viewed as: its leading axes by the rest, split
    where rows + cols is least (an attention output kernel of shape (heads,
    head_dim, dim) is (heads * head_dim) x dim, not heads x the rest)."""
    splits = [(int(np.prod(shape[:k], dtype=np.int64)), int(np.prod(shape[k:], dtype=np.int64)))
              for k in range(1, len(shape))]
    return min(splits, key=lambda rc: (rc[0] + rc[1], rc[0]))


def workers_mean(tree, axis_name, codec: str = "none"):
    """The mean of `tree` over the workers: processes (axis_name None) or a
    mesh axis inside shard_map."""
    if axis_name is None:
        return allreduce(tree, op="mean", codec=codec)
    return pmean(tree, axis_name, codec=codec)


def powersgd(rank: int = 4, axis_name=None, *, min_compression: float = 2.0,
             error_feedback: bool = True, seed: int = 0, warmup_steps: int = 0,
             codec: str = "none", power_iterations: int = 1) -> optax.GradientTransformation:
    """Averages gradients across workers as rank-``rank`` approximations.

    Use it first in an ``optax.chain`` instead of ``allreduce_gradients``.

    Args:
      rank: the rank of each approximation (PowerSGD's r; 1 to 8 is usual).
      axis_name: None reduces across processes (one process per accelerator);
        a mesh axis name (or tuple) reduces over it inside ``jax.shard_map``
        (``check_vma=False``), as ``allreduce_gradients`` does.
      min_compression: a float32 leaf of 2+ dimensions is compressed only if
        rows * cols >= min_compression * (rows + cols) * rank; others are
        averaged exactly.
      error_feedback: keep what each worker's approximation missed and add it
        to its next gradient (needed for convergence in practice).
      seed: the initial Q of every leaf comes from it, the same on every
        worker (the factors of different workers must agree).
      warmup_steps: the first ``warmup_steps`` updates average every leaf
        exactly, as PyTorch's ``start_powerSGD_iter`` does; each of them
        sends the uncompressed bytes. (On examples/train_lm.py with adamw
        it did not narrow the loss gap: see BENCHMARKS.md.)
      codec: the wire codec of the factors (``"none"``, ``"bf16"``,
        ``"fp16"``, ``"int8"``, as for ``pmean(codec=...)``). ``"bf16"`` halves
        their bytes; on examples/train_lm.py it raised the held-out loss by
        0.12 points in the mean of three seeds (-0.09 to +0.54 per seed; see
        BENCHMARKS.md). The leaves averaged exactly stay float32.
      power_iterations: power-iteration steps per update (each reduces P
        and Q once more): a closer approximation for that many times the
        factor bytes.

    Returns:
      An ``optax.GradientTransformation`` whose state (``PowerSGDState``) holds
      the warm-start factors and residuals, checkpointable like any optimizer
      state.
    """
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be 0 or more, got {warmup_steps}")
    if power_iterations < 1:
        raise ValueError(f"power_iterations must be at least 1, got {power_iterations}")
    codecs.check_codec(codec)

    def mean(tree):
        return workers_mean(tree, axis_name)

    def factor_mean(tree):
        return workers_mean(tree, axis_name, codec)

    def compressed(x) -> bool:
        if np.ndim(x) < 2 or np.dtype(x.dtype) != np.float32:
            return False
        rows, cols = _matrix_shape(x.shape)
        return rows * cols >= min_compression * (rows + cols) * rank

    def init_fn(params):
        leaves, treedef = jax.tree_util.tree_flatten(params)
        key = jax.random.PRNGKey(seed)
        qs, residuals = [], []
        for i, p in enumerate(leaves):
            if compressed(p):
                _, cols = _matrix_shape(p.shape)
                qs.append(jax.random.normal(jax.random.fold_in(key, i), (cols, rank),
                                            jnp.float32))
                residuals.append(jnp.zeros(p.shape, jnp.float32) if error_feedback
                                 else jnp.zeros((), jnp.float32))
            else:
                qs.append(jnp.zeros((), jnp.float32))
                residuals.append(jnp.zeros((), jnp.float32))
        return PowerSGDState(jax.tree_util.tree_unflatten(treedef, qs),
                             jax.tree_util.tree_unflatten(treedef, residuals),
                             jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        # A weighted mean is not built in here: refuse the weight that
        # optax.chain would otherwise hand on to be dropped.
        step_weight(None, extra_args, "powersgd", supported=False)
        del params
        check_gradients(updates, axis_name, "powersgd")
        if state.count is None:
            raise ValueError("this PowerSGDState has no update count: make it with "
                             "herring_jax.powersgd(...).init(params)")
        # Counts up to warmup_steps and stays there (no int32 wrap-around).
        count = jnp.where(state.count < warmup_steps, state.count + 1, state.count)
        if warmup_steps == 0:
            return compressed_update(updates, state._replace(count=count))
        # Every process takes the same branch: count is the same everywhere.
        return jax.lax.cond(state.count < warmup_steps,
                            lambda u, st: (mean(u), st),
                            compressed_update, updates, state._replace(count=count))

    def compressed_update(updates, state):
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        qs = treedef.flatten_up_to(state.q)
        residuals = treedef.flatten_up_to(state.residual)
        which = [i for i, g in enumerate(leaves) if compressed(g)]
        exact = [i for i in range(len(leaves)) if i not in which]
        out = list(leaves)
        if exact:
            for i, r in zip(exact, mean([leaves[i] for i in exact])):
                out[i] = r
        new_q, new_residual = list(qs), list(residuals)
        if which:
            ms = {}
            for i in which:
                m = leaves[i].reshape(_matrix_shape(leaves[i].shape))
                if error_feedback:
                    m = m + residuals[i].reshape(m.shape)
                ms[i] = m
            q_means = [qs[i] for i in which]
            for _ in range(power_iterations):
                ps = factor_mean([ms[i] @ q for i, q in zip(which, q_means)])
                p_hats = {i: jnp.linalg.qr(p)[0] for i, p in zip(which, ps)}
                q_means = factor_mean([ms[i].T @ p_hats[i] for i in which])
            for i, q in zip(which, q_means):
                approx = p_hats[i] @ q.T
                out[i] = approx.reshape(leaves[i].shape)
                new_q[i] = q
                if error_feedback:
                    new_residual[i] = (ms[i] - approx).reshape(leaves[i].shape)
        return (jax.tree_util.tree_unflatten(treedef, out),
                PowerSGDState(jax.tree_util.tree_unflatten(treedef, new_q),
                              jax.tree_util.tree_unflatten(treedef, new_residual),
                              state.count))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
