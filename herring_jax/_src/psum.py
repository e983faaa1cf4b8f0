"""herring_jax.psum / pmean: drop-ins for jax.lax.psum / pmean inside
jax.shard_map (and pmap), reduced by the Herring engine.

Devices of one process that belong to the same group are summed inside the
process first; one copy per process crosses processes.
"""

from __future__ import annotations

from typing import Any

import jax

from herring_jax._src import allreduce as _allreduce


def _axes(axis_name) -> tuple:
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes:
        raise ValueError("axis_name must name at least one mesh axis")
    return axes


def _reduce(x: Any, axis_name, op: str, axis_index_groups) -> Any:
    if axis_index_groups is not None:
        raise NotImplementedError("herring_jax.psum does not support axis_index_groups")
    axes = _axes(axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if not leaves:
        return x
    leaves = [jax.numpy.asarray(v) for v in leaves]
    for i, v in enumerate(leaves):
        _allreduce._check_leaf(i, v, op)
    outs = _allreduce.allreduce_p.bind(*leaves, op=op, axes=axes)
    return jax.tree_util.tree_unflatten(treedef, outs)


def psum(x: Any, axis_name, *, axis_index_groups=None) -> Any:
    """Sums a pytree over the named mesh axes, like ``jax.lax.psum``.

    Use inside ``jax.shard_map`` (or ``jax.pmap``). ``axis_name`` is one mesh
    axis name or a tuple of them; on a 2-D mesh ('data', 'model'),
    ``psum(x, 'data')`` reduces only among devices with the same 'model'
    coordinate. Differentiable and batchable like lax.psum.

    Args:
      x: a pytree of arrays (float32, float64, bfloat16, float16, int32, int64).
      axis_name: a mesh axis name or a tuple of names.

    Returns:
      The pytree of sums, the same on every device of the reduced axes.

    Examples:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("i",))     # doctest: +SKIP
      >>> f = jax.shard_map(lambda x: herring_jax.psum(x, "i"), mesh=mesh,
      ...                   in_specs=P("i"), out_specs=P())        # doctest: +SKIP
    """
    return _reduce(x, axis_name, "sum", axis_index_groups)


def pmean(x: Any, axis_name, *, axis_index_groups=None) -> Any:
    """Averages a pytree over the named mesh axes, like ``jax.lax.pmean``.

    The division by the number of devices happens on the server, off the
    accelerator. Floating dtypes only.
    """
    return _reduce(x, axis_name, "mean", axis_index_groups)
