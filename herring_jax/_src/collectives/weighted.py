"""Weighted means: sum_i(w_i x_i) / sum_i(w_i) over processes or mesh axes.

Any-batch training (distributed any-batch mirror descent) gives every worker
the same time per step; a slow one takes fewer examples, and each worker's
gradient counts in proportion to the examples (or tokens) it used, so that a
straggler delays no one. allreduce(op="mean", weight=w), pmean(weight=w) and
allreduce_gradients(weight=True) reduce through here.

The arithmetic, exactly (tests/workers/weighted_worker.py is its numpy
model). Per leaf of dtype d, with c = float64 for float64 / complex128 leaves
and float32 for every other floating dtype:
  1. w = float32(weight); a process whose w is 0 contributes exact zeros,
     whatever its x (a process that took no examples may hold NaN);
  2. p = d(c(x) * c(w)) on each device (complex: real and imaginary parts
     each times w);
  3. S = herring's sum of the p (its documented order; 16-bit types
     accumulate in float32 and round once) and W = herring's sum of the
     float32 w, in the same reduction: the weight is one more operand of it
     (kept out of a lossy codec, whose encoding would bend it);
  4. r = c(1) / c(W), one scalar division, and result = d(c(S) * r).
Every process gets the same S and W, so the same bits. Not d(c(S) / c(W)):
XLA rewrites the division of an array by a broadcast scalar into that
multiplication by its reciprocal where it sees one (eagerly and under jit
alike, depending on what it fuses), so only the reciprocal is well defined.

A total weight of 0 (no process took an example) gives exact zeros, not
NaN. A negative, NaN or infinite weight on any process gives NaN in every
leaf on every process (the count of such weights travels with W), and
outside jax.jit raises ValueError on every process after the reduction; a
rank that raised alone would leave the others waiting for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The weight operand: [w, 1.0 if w is negative or not finite else 0.0].
WEIGHT_SLOTS = 2


def check_weight(weight, api: str):
    """The weight as a float32 scalar; ValueError / TypeError naming `api`
    for anything else (an array of several values, complex, not a number)."""
    raw = getattr(weight, "dtype", None)
    dtype = np.dtype(raw) if raw is not None else np.asarray(weight).dtype
    if dtype.kind not in "biuf":
        raise TypeError(f"{api}: weight must be a real number (this process's share, e.g. "
                        f"the examples or tokens it used), got dtype {dtype.name}")
    shape = np.shape(weight)
    if shape != ():
        raise ValueError(
            f"{api}: weight must be a scalar, one number per process (or per device inside "
            f"shard_map), got shape {shape}; a weight per element is not a weighted mean: "
            "multiply by it and reduce with op='sum' instead")
    return jnp.asarray(weight).astype(jnp.float32)


def check_op(op: str, api: str) -> None:
    if op != "mean":
        raise ValueError(f"{api}: weight= needs op='mean' (the weighted mean "
                         f"sum(w_i x_i) / sum(w_i)), got op={op!r}; for a weighted sum "
                         "multiply by the weight yourself and reduce with op='sum'")


def check_floating(names, leaves, api: str) -> None:
    for name, x in zip(names, leaves):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise TypeError(f"{api}: {name} has dtype {np.dtype(x.dtype).name}; a weighted mean "
                            "needs floating leaves: cast it to float first")


def weight_operand(w):
    """What the reduction sums beside the data: [w, bad], float32."""
    bad = jnp.logical_or(w < 0, jnp.logical_not(jnp.isfinite(w)))
    return jnp.stack([w, bad.astype(jnp.float32)])


def _compute_dtype(dtype):
    return jnp.float64 if np.dtype(dtype) in (np.float64, np.complex128) else jnp.float32


def scaled(x, w):
    """Step 2: this device's contribution w * x, rounded once to x's dtype
    (exact zeros where w is 0)."""
    c = _compute_dtype(x.dtype)
    wc = w.astype(c)
    if jnp.iscomplexobj(x):
        p = jax.lax.complex(x.real.astype(c) * wc, x.imag.astype(c) * wc)
    else:
        p = x.astype(c) * wc
    p = p.astype(x.dtype)
    return jnp.where(w == 0, jnp.zeros_like(p), p)


def divided(s, total):
    """Step 4: c(S) * (1 / c(W)) in S's dtype; zeros where W is 0, NaN where
    a weight was bad (total = the reduced weight operand)."""
    c = _compute_dtype(s.dtype)
    w, bad = total[0].astype(c), total[1]
    r = jnp.ones_like(w) / jnp.where(w == 0, jnp.ones_like(w), w)
    if jnp.iscomplexobj(s):
        out = jax.lax.complex(s.real.astype(c) * r, s.imag.astype(c) * r)
    else:
        out = s.astype(c) * r
    out = jnp.where(w == 0, jnp.zeros_like(out), out)
    out = jnp.where(bad > 0, jnp.full_like(out, jnp.nan), out)
    return out.astype(s.dtype)


def check_total_eagerly(total, api: str) -> None:
    """Outside jit (a concrete total): raises on every process alike when
    some process passed a negative or non-finite weight."""
    if isinstance(total, jax.core.Tracer):
        return
    bad = int(np.asarray(total)[1])
    if bad:
        raise ValueError(
            f"{api}: {bad} weight(s) across the processes were negative, NaN or infinite; "
            "weights must be finite and >= 0 (e.g. the examples each process used). Inside "
            "jax.jit such a step gives NaN in every leaf instead")


def mean(leaves, weight, codec: str, api: str, binder) -> list:
    """The weighted mean of `leaves` (floating, checked) with the float32
    `weight`: their products and the weight operand summed by
    `binder(arrays, codec)` in one reduction (the operand in a reduction of
    its own under a lossy codec, which would bend it), then divided."""
    products = [scaled(x, weight) for x in leaves]
    operand = weight_operand(weight)
    if codec == "none":
        *sums, total = binder(products + [operand], codec)
    else:
        sums = binder(products, codec)
        [total] = binder([operand], "none")
    check_total_eagerly(total, api)
    return [divided(s, total) for s in sums]
