"""vmap of herring_allreduce (allreduce.py): how a batched reduction is bound.

vmap over an axis the reduction does not name: the batch is just more
elements (a reduce-scatter keeps its operands' leading dimension G first).
vmap(..., axis_name=n) with n among the reduced axes: as lax, the batch is
reduced in place (an unbatched operand counts axis_size times for a sum)
and the rest of the axes go to the engine; the result is no longer batched.
A reduce-scatter or all-gather over the vmapped axis alone is done in place
too, as lax does (over it and mesh axes together, lax fails as well).
"""

from __future__ import annotations

import jax
import numpy as np

from herring_jax._src.process import jax_compat

_REDUCERS = {"max": jax.lax.reduce_max, "min": jax.lax.reduce_min}


def _reduce_batch_in_place(axis_data, args, dims, op, axes, groups):
    """The in-place step: the local results and the axes left to reduce."""
    if groups is not None:
        raise NotImplementedError(
            "axis_index_groups is not supported for an axis bound by jax.vmap (nor by lax)")
    size = axis_data.size
    local = []
    for x, d in zip(args, dims):
        if d is jax_compat.not_mapped:
            local.append(x * np.asarray(size, x.dtype) if op == "sum" else x)
        else:
            s = _REDUCERS.get(op, jax.lax.reduce_sum)(x, (d,))
            local.append(s / np.asarray(size, x.dtype) if op == "mean" else s)
    return local, tuple(a for a in axes if a != axis_data.name)


def _half_in_place(axis_data, args, dims, op, axes, groups, collective, api):
    """A reduce-scatter or all-gather over the vmapped axis alone: its results
    and their batch dimensions."""
    if groups is not None:
        raise NotImplementedError(
            f"{api}: axis_index_groups is not supported over an axis bound by jax.vmap "
            "(nor by jax.lax)")
    if tuple(axes) != (axis_data.name,):
        raise NotImplementedError(
            f"{api} over {tuple(axes)} mixes the axis {axis_data.name!r} bound by jax.vmap "
            "with mesh axes, which herring_jax (like jax.lax) does not support: call it "
            "twice, once over the vmapped axis and once over the mesh axes")
    size = axis_data.size
    outs, out_dims = [], []
    for x, d in zip(args, dims):
        if collective == "reduce_scatter":
            # Element i of the batch gets the sum of every element's row i.
            if d is jax_compat.not_mapped:
                y = x * np.asarray(size, x.dtype) if op == "sum" else x
            else:
                y = jax.lax.reduce_sum(x, (d,))
                y = y / np.asarray(size, x.dtype) if op == "mean" else y
            outs.append(y)
            out_dims.append(0)
        else:
            # Every element of the batch gets all of them, in batch order.
            if d is jax_compat.not_mapped:
                y = jax.numpy.broadcast_to(x[None], (size, *x.shape))
            else:
                y = jax.numpy.moveaxis(x, d, 0)
            outs.append(y)
            out_dims.append(jax_compat.not_mapped)
    return outs, out_dims


def _half_unnamed(args, dims, collective):
    """Operands and result batch dimensions of a reduce-scatter or all-gather
    vmapped over an axis it does not reduce."""
    operands, out_dims = [], []
    for x, d in zip(args, dims):
        if d is jax_compat.not_mapped:
            operands.append(x)
            out_dims.append(d)
        elif collective != "reduce_scatter":  # an all-gather
            operands.append(x)
            out_dims.append(d + 1)
        elif d == 0:
            operands.append(jax.numpy.moveaxis(x, 0, 1))  # G stays first
            out_dims.append(0)
        else:
            operands.append(x)
            out_dims.append(d - 1)
    return operands, out_dims


def batched(axis_data, args, dims, params, api: str):
    """How herring_allreduce with `params`, batched along `dims` of `args`
    (axis_data: the vmapped axis's name and size), is bound: (operands, params,
    result batch dims), or (None, results, result batch dims) where nothing is
    left to reduce. `api` names the public function in errors."""
    op, axes, groups, collective = (params[k] for k in ("reduction", "axes", "groups", "collective"))
    named = axes is not None and axis_data.name in axes
    if collective == "allreduce":
        if not named:
            return list(args), params, list(dims)
        local, rest = _reduce_batch_in_place(axis_data, args, dims, op, axes, groups)
        out_dims = [jax_compat.not_mapped] * len(local)
        if rest:
            return local, {**params, "axes": rest}, out_dims
        return None, local, out_dims
    if not named:
        operands, out_dims = _half_unnamed(args, dims, collective)
        return operands, params, out_dims
    return (None, *_half_in_place(axis_data, args, dims, op, axes, groups, collective, api))
