"""Several accelerators of one process summed on the accelerators before the
host copy (HERRING_DEVICE_LOCAL_SUM, XLA:CUDA and the CPU double).

Herring reduces inside the node first. On XLA:CUDA without this, each of a
process's D GPUs copies its whole buffer B to pinned host memory and the
host sums the D copies (the engine's local rendezvous): D x B over PCIe each
way, and D x B of host summing. With it, a psum over a mesh axis that puts D
devices on each of P processes (P, D >= 2) lowers to

  1. a reduce-scatter among each process's own D devices: XLA's collective,
     NCCL over NVLink on XLA:CUDA; each device keeps 1/D of the local sum;
  2. herring's start and done on that 1/D slice, across the P processes,
     in D groups (the d-th device of every process): B/D to the host and
     back per device, B per process;
  3. an all-gather among the process's D devices, which puts the whole sum
     on each of them.

Each operand is flattened and padded to a multiple of D first, and cut back
after. A mean is the sum divided by P x D at the end. Every device of every
process gets the same bits, but not those of the host path: the local sum is
XLA's (its order, and half-precision types summed in their own type), not
herring's rank-order float32 sum. Hence off by default; docs/guides/gpus.md.

Not split: broadcasts, reduce-scatters and all-gathers, error feedback (its
losses are per device), axis_index_groups, booleans, a mean of integers, and
layouts without D >= 2 devices on each of P >= 2 processes alike for every
coordinate of the other mesh axes (layout.local_split). Those keep the host
path.

With allreduce_gradients' buckets (split.split_reductions) the reduce-scatter
comes before the bucket's start (lowering.lower_start) and the all-gather
after its done (lowering.lower). The CPU double lowers the whole sequence
where the done is (its start emits nothing): its done must take the start's
operands to keep them alive (double_handlers.cc), and the slices exist only
in the lowering that made them.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.interpreters import mlir

from herring_jax._src.process import jax_compat
from herring_jax._src.process import knobs
from herring_jax._src.process import layout

_REDUCERS = {"sum": jax.lax.add_p, "mean": jax.lax.add_p, "max": jax.lax.max_p,
             "min": jax.lax.min_p}


def split_for(ctx, avals, *, on_device: bool, op, axes, groups, root, collective,
              feedback, codec) -> layout.LocalSplit | None:
    """The local split of this reduction, or None where it keeps the host
    path (the module's docstring says when). A wire codec applies to the
    slices, across processes."""
    del codec
    if not on_device or not knobs.get("HERRING_DEVICE_LOCAL_SUM"):
        return None
    if collective != "allreduce" or root is not None or feedback or op not in _REDUCERS:
        return None
    for a in avals:
        if a.dtype == np.bool_:
            return None
        if op == "mean" and not jax.numpy.issubdtype(a.dtype, jax.numpy.inexact):
            return None
    return layout.local_split(ctx, axes, groups)


def middle(split: layout.LocalSplit, params: dict) -> dict:
    """The parameters of herring's call across processes: the same, over the
    groups of the d-th devices, a mean as a sum."""
    op = "sum" if params["op"] == "mean" else params["op"]
    return dict(params, op=op, groups=split.across)


def slice_avals(split: layout.LocalSplit, avals) -> list:
    """What each device sends across processes: 1/D of its padded operand."""
    d = split.per_process
    return [jax.core.ShapedArray((-(-a.size // d),), a.dtype) for a in avals]


def scatter(ctx, split: layout.LocalSplit, axes, op, operands, avals, *, cpu: bool) -> list:
    """Each operand flattened, padded and reduce-scattered among the
    process's devices: its 1/D slice of the local sum. cpu: on XLA:CPU (the
    double), where _reduce_scatter_cpu stands in for XLA's reduce-scatter."""
    d = split.per_process
    out = []
    for x, a, s in zip(operands, avals, slice_avals(split, avals)):
        padded = jax.core.ShapedArray((s.shape[0] * d,), a.dtype)
        pad = padded.shape[0] - a.size
        [flat] = mlir.lower_fun(lambda v: [jax.numpy.pad(v.reshape(-1), (0, pad))],
                                multiple_results=True)(
            ctx.replace(avals_in=[a], avals_out=[padded]), x)
        if cpu:
            part = _reduce_scatter_cpu(ctx, split, axes, op, flat, padded, s)
        else:
            [part] = jax_compat.reduce_scatter_hlo(
                ctx.replace(avals_in=[padded], avals_out=[s]), flat, _REDUCERS[op], axes=axes,
                groups=split.local, size=d)
        out.append(part)
    return out


def _reduce_scatter_cpu(ctx, split, axes, op, flat, padded, part):
    """XLA:CPU's reduce-scatter among a process's devices, built from its
    all-gather: jax 0.10's XLA:CPU reduce-scatter between devices of one
    process returned wrong elements at the end of a slice, now and then, for
    slices of 256 KiB and more (a float64 psum_scatter alone, no herring
    call in the program, 1 run in 3; its all-gather and all-reduce never).
    Each device gathers every device's padded operand and sums its own slice
    of them in the group's order, as XLA:CUDA's reduce-scatter sums (for 2
    devices any order gives the same bits)."""
    d = split.per_process
    gathered = jax.core.ShapedArray((d * padded.shape[0],), padded.dtype)
    [whole] = jax_compat.all_gather_hlo(
        ctx.replace(avals_in=[padded], avals_out=[gathered]), flat, axes=axes,
        groups=split.local, size=d)
    position = np.zeros(max(max(g) for g in split.local) + 1, np.int32)
    for group in split.local:
        for j, index in enumerate(group):
            position[index] = j
    combine = {"max": jax.numpy.maximum, "min": jax.numpy.minimum}.get(op, jax.numpy.add)

    def own_part(w):
        blocks = w.reshape(d, d, part.shape[0])  # [source device, slice, element]
        me = jax.numpy.asarray(position)[jax.lax.axis_index(tuple(axes))]
        mine = jax.lax.dynamic_index_in_dim(blocks, me, axis=1, keepdims=False)
        acc = mine[0]
        for j in range(1, d):
            acc = combine(acc, mine[j])
        return [acc]

    [r] = mlir.lower_fun(own_part, multiple_results=True)(
        ctx.replace(avals_in=[gathered], avals_out=[part]), whole)
    return r


def gather(ctx, split: layout.LocalSplit, axes, op, parts, avals_out) -> list:
    """The slices reduced across processes, all-gathered among the process's
    devices and cut back to the results' shapes (a mean divided)."""
    d = split.per_process
    out = []
    for part, a, s in zip(parts, avals_out, slice_avals(split, avals_out)):
        padded = jax.core.ShapedArray((s.shape[0] * d,), a.dtype)
        [whole] = jax_compat.all_gather_hlo(
            ctx.replace(avals_in=[s], avals_out=[padded]), part, axes=axes,
            groups=split.local, size=d)
        n = split.contributors

        def finish(v, a=a, n=n):
            v = v[:a.size].reshape(a.shape)
            return [v / np.asarray(n, a.dtype) if op == "mean" else v]

        [r] = mlir.lower_fun(finish, multiple_results=True)(
            ctx.replace(avals_in=[padded], avals_out=[a]), whole)
        out.append(r)
    return out
