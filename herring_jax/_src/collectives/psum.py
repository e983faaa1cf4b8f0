"""herring_jax.psum / pmean / pmax / pmin: drop-ins for jax.lax's inside
jax.shard_map (with or without check_vma) and jax.pmap, reduced by the
Herring engine; axes bound by jax.vmap(..., axis_name=...) are reduced in
place, as lax does.

Devices of one process that belong to the same group are summed inside the
process first, then the group's processes of each host through memory; only
each host's share crosses the network.

Each call is one equation whose str() is the name of the primitive lax
binds for it (psum_invariant under shard_map's varying-axis checks, psum
without them, unreduced_psum for values unreduced over the axes, pmax, pmin;
composite.py), so that remat policies and jaxpr readers treat it as lax's.

Where lax and herring differ, by design: sums are taken in a fixed order
(local devices, then the processes of a host by rank, then the hosts), so
floating results are bitwise reproducible but may differ from XLA's own
all-reduce in the last bits; a pmean of floating values divides on the server.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from herring_jax._src.collectives import allreduce as _allreduce
from herring_jax._src.collectives import codecs
from herring_jax._src.collectives import composite
from herring_jax._src.process import jax_compat
from herring_jax._src.process import layout
from herring_jax._src.collectives import weighted


def _axes(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _groups(axis_index_groups):
    """lax's checks and canonical form of axis_index_groups."""
    if axis_index_groups is None:
        return None
    groups = tuple(tuple(int(i) for i in g) for g in axis_index_groups)
    covered = sorted(i for g in groups for i in g)
    if covered != list(range(len(covered))):
        raise ValueError("axis_index_groups must cover all indices exactly once")
    return groups


def _reduce(x: Any, axis_name, op: str, axis_index_groups, codec: str = "none",
            weight=None) -> Any:
    codecs.check_codec(codec)
    api = f"herring_jax.p{op}"
    if weight is not None:
        weight = weighted.check_weight(weight, api)
    axes = jax_compat.skip_one_sized_axes(_axes(axis_name))
    groups = _groups(axis_index_groups)
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if not leaves:
        return x
    if axes and any(isinstance(a, int) for a in axes):
        raise TypeError(f"{api} reduces named axes only, got {axes}; for positional axes "
                        f"use jnp.{op}")
    # A max or min keeps bool (a logical or / and), as lax: reduced as uint8.
    extreme = op in ("max", "min")
    was_bool = [_allreduce.is_bool(v) for v in leaves]
    names = _allreduce.leaf_names(x)
    leaves = [_allreduce.prepare_leaf(name, v, np.uint8 if extreme else np.int32)
              for name, v in zip(names, leaves)]
    for name, v in zip(names, leaves):
        _allreduce.check_extreme(name, v, op, codec)
    if axes:
        # lax's NameError, while tracing, for an axis nothing binds.
        jax_compat.check_axis_names(axes, api)
    if weight is not None:
        weighted.check_floating(names, leaves, api)
        return jax.tree_util.tree_unflatten(
            treedef, _weighted(leaves, weight, axes, groups, codec, api))
    # lax.pmean is psum / n. The engine averages floating values of a real
    # reduction on the server; everything else is divided here, which gives
    # integers a floating mean, as in lax.
    if not axes:
        outs, divide, n = leaves, [True] * len(leaves), 1
    elif not any(isinstance(v, jax.core.Tracer) for v in leaves):
        # Constants (e.g. psum(1, 'i') for the axis size): every device holds
        # the same value, so the sum is the value times the group size (and
        # the max the value).
        n = layout.group_size(axes, groups)
        outs = leaves if extreme else [v * n for v in leaves]
        divide = [True] * len(leaves)
    else:
        outs = _bind(leaves, axes, groups, op, codec, api)
        divide = [not _allreduce.is_floating(v) for v in leaves]
        n = layout.group_size(axes, groups) if op == "mean" and any(divide) else 1
    if op == "mean":
        outs = [o / n if d else o for o, d in zip(outs, divide)]
    if extreme:
        outs = [o.astype(np.bool_) if b else o for o, b in zip(outs, was_bool)]
    return jax.tree_util.tree_unflatten(treedef, outs)


def _weighted(leaves, weight, axes, groups, codec, api):
    """pmean(weight=): weighted.py's arithmetic over the mesh axes."""
    if not axes:
        # Nothing to reduce over: this device's own weighted mean.
        return weighted.mean(leaves, weight, codec, api, lambda xs, c: xs)
    if not any(isinstance(v, jax.core.Tracer) for v in [*leaves, weight]):
        # Constants, the same on every device: each device's product and
        # weight counted once per device (as psum of a constant).
        n = layout.group_size(axes, groups)
        return weighted.mean(leaves, weight, codec, api,
                             lambda xs, c: [v * np.asarray(n, v.dtype) for v in xs])
    # A weight that is the same on every device (a constant, or a value
    # invariant over the axes) is every device's: vary it as lax's psum would.
    weight = jax_compat.vary_over(weight, axes)
    return weighted.mean(leaves, weight, codec, api,
                         lambda xs, c: _bind(xs, axes, groups, "sum", c, api))


def _vary(v, axes, op: str, api: str):
    """The operand as lax takes it where shard_map checks varying axes: a
    value the same on every device of the axes is first marked varying, so
    that a sum counts it once per device (lax.psum); a max or min also marks
    a value varying over only some of the axes (lax.pmax)."""
    aval = jax.typeof(v)
    if op in ("max", "min"):
        if jax_compat.is_unreduced(aval, axes):
            raise ValueError(f"{api} cannot accept args which are unreduced (nor can "
                             f"jax.lax.p{op}); got {aval.str_short(True)} and axes="
                             f"{set(axes)}: reduce them first with herring_jax.psum")
        state = "varying" if jax_compat.varies_over_all(aval, axes) else "invarying"
    else:
        state = jax_compat.axis_state(aval, axes, api)
    if state == "reduced":
        raise ValueError(f"{api} cannot accept args which are reduced. Got "
                         f"{aval.str_short(True)} and axes={set(axes)}")
    if state == "invarying" and jax_compat.auto_pcast_enabled():
        return jax_compat.vary_over(v, axes)
    if state == "invarying":
        raise ValueError(
            f"p{op} is a variant->invariant collective: the axes {axes} must be among "
            f"the input's varying axes ({aval.str_short(True)})")
    return v


def _bind(leaves, axes, groups, op, codec, api):
    check_vma = jax_compat.check_vma_enabled()
    if check_vma:
        if groups is not None and op in ("sum", "mean"):
            raise NotImplementedError(
                f"axis_index_groups needs jax.shard_map(..., check_vma=False) or jax.pmap, as "
                f"for jax.lax.p{op}")
        leaves = [_vary(v, axes, op, api) for v in leaves]
    # Integers are averaged after the sum (see _reduce).
    ops = ["sum" if op == "mean" and not _allreduce.is_floating(v) else op for v in leaves]
    # One equation per kind of leaf, named as lax's primitive for it (a remat
    # policy or jaxpr reader that looks for lax's sees herring's; composite.py).
    labels = [_lax_primitive(op, v, axes, check_vma) for v in leaves]
    outs = [None] * len(leaves)
    for label in sorted(set(labels)):
        idx = [i for i, k in enumerate(labels) if k == label]
        kind_ops = [ops[i] for i in idx]
        results = composite.bind(
            label, functools.partial(_reduce_leaves, ops=kind_ops, codec=codec, axes=axes,
                                     groups=groups),
            [leaves[i] for i in idx],
            functools.partial(_reduced_cotangents, axes=axes, mean=op == "mean")
            if label == "unreduced_psum" else None,
            functools.partial(_not_differentiable, op) if op in ("max", "min") else None)
        for i, r in zip(idx, results):
            outs[i] = r
    return outs


def _reduce_leaves(*leaves, ops, codec, axes, groups):
    return _allreduce.bind_grouped(list(leaves), ops=ops, codec=codec, axes=axes, groups=groups)


def _reduced_cotangents(cts, avals, known, *, axes, mean):
    del known
    """The transpose of a sum of unreduced operands, as lax's unreduced_psum:
    the cotangent, the same on every device, typed reduced (no traffic)."""
    n = layout.group_size(axes, None)
    return [jax_compat.preduced(ct / np.asarray(n, ct.dtype) if mean else ct, axes)
            if composite.inexact(a) else None for ct, a in zip(cts, avals)]


def _lax_primitive(op: str, v, axes, check_vma: bool) -> str:
    """The name of the primitive lax binds for this leaf (pmean: its psum)."""
    if op in ("max", "min"):
        return f"p{op}"
    if check_vma and jax_compat.is_unreduced(jax.typeof(v), axes):
        return "unreduced_psum"
    return "psum_invariant" if check_vma else "psum"


def _not_differentiable(op, primals, tangents):
    raise NotImplementedError(
        f"herring_jax's p{op} (and allreduce(op={op!r})) is not differentiable, as "
        f"jax.lax.p{op} is not (\"Differentiation rule for 'p{op}' not implemented\"): "
        "apply it to jax.lax.stop_gradient(x) where its gradient is not needed")


def check_axes_bound(axis_name, api: str) -> None:
    """NameError, naming `api` (the function the user called), for a mesh
    axis that no enclosing shard_map, pmap or vmap binds (None: processes)."""
    if axis_name is None:
        return
    axes = _axes(axis_name)
    if not any(isinstance(a, int) for a in axes):
        jax_compat.check_axis_names(axes, f"herring_jax.{api}({axis_name!r})")


def check_gradients(tree: Any, axis_name, api: str, *, average: bool = True) -> None:
    """What every gradient transformation checks first, in the words of the
    transformation the user called (`api`, e.g. "allreduce_gradients"): the
    axis names are bound, every leaf can be averaged, and the gradients are
    per device (check_per_device_gradients)."""
    check_axes_bound(axis_name, api)
    if average:
        shown = _allreduce.non_floating_leaves(tree)
        if shown:
            raise TypeError(
                f"herring_jax.{api}: the gradients {shown} are not floating point, and "
                "averaging them across workers needs a floating dtype. Integer and bool "
                "leaves are usually state rather than trainable parameters: leave them out "
                "of the tree given to the optimizer (optax.masked, or a filter such as "
                "nnx.Param in nnx.Optimizer(..., wrt=...)), or cast them to float"
                + (" (allreduce_gradients and sharded_optimizer with average=False sum "
                   "them exactly)" if api in ("allreduce_gradients", "sharded_optimizer")
                   else "") + ".")
    check_per_device_gradients(tree, axis_name, api)


def check_per_device_gradients(tree: Any, axis_name, api: str) -> None:
    """Refuses gradients that jax has already reduced over `axis_name`.

    Inside ``jax.shard_map(..., check_vma=True)`` (jax's default) a parameter
    replicated over the mesh is used through an implicit ``pvary``, whose
    transpose is a ``psum``: its gradient comes out of the backward pass
    already summed over the axis (by XLA's own collectives), and no longer
    varying. Averaging it once more would be a no-op (lax.pmean of an
    invariant value is that value), so a data-parallel step would move N times
    too far. Which share of such a gradient is "per device" cannot be told from
    the value (a loss that was pmean'd first gives the mean, not the sum), so
    it is refused while tracing instead of guessed. Gradients that vary over
    the axes (check_vma=False, pmap, parameters marked varying) pass.
    """
    if axis_name is None or not jax_compat.check_vma_enabled():
        return
    axes = jax_compat.skip_one_sized_axes(_axes(axis_name))
    if not axes:
        return
    paths = [jax.tree_util.keystr(path)
             for path, g in jax.tree_util.tree_flatten_with_path(tree)[0]
             if isinstance(g, jax.core.Tracer) and np.size(g) > 0
             and not jax_compat.varies_over_all(jax.typeof(g), axes)]
    if not paths:
        return
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    raise ValueError(
        f"{api}({axis_name!r}) inside jax.shard_map(..., check_vma=True): the gradients "
        f"{shown} do not vary over {axes}, so jax has already summed them over the mesh in "
        "the backward pass (the transpose of the implicit pvary of a replicated parameter), "
        "and reducing them again would scale the step by the axis size. Pass "
        "check_vma=False to jax.shard_map, so that each device's gradients reach "
        f"{api} unreduced and herring_jax averages them, or leave {api} out of the chain "
        "and divide jax's sum by the axis size yourself.")


def psum(x: Any, axis_name, *, axis_index_groups=None, codec: str = "none") -> Any:
    """Sums a pytree over the named axes, like ``jax.lax.psum``.

    Use inside ``jax.shard_map`` (with or without ``check_vma``) or
    ``jax.pmap``; an axis bound by ``jax.vmap(..., axis_name=...)`` is summed in
    place. ``axis_name`` is one axis name or a tuple of them; on a 2-D mesh
    ('data', 'model'), ``psum(x, 'data')`` reduces only among devices with the
    same 'model' coordinate. ``axis_index_groups`` splits the axis as in lax
    (not with ``check_vma=True``, nor over a vmapped axis, as in lax).
    Differentiable and batchable like lax.psum, with lax's transposes in both
    varying-axis modes. bool is summed as int32, as in lax.

    Args:
      x: a pytree of arrays (float16/32/64, bfloat16, complex64/128,
        (u)int8/16/32/64, bool).
      axis_name: an axis name or a tuple of names.
      axis_index_groups: optional list of lists of axis indices.
      codec: herring_jax only: how float32 leaves cross between processes,
        ``"none"`` (exact, the default), ``"bf16"``, ``"fp16"`` or ``"int8"``;
        see ``herring_jax.allreduce``.

    Returns:
      The pytree of sums, the same on every device of the reduced axes.

    Examples:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("i",))     # doctest: +SKIP
      >>> f = jax.shard_map(lambda x: herring_jax.psum(x, "i"), mesh=mesh,
      ...                   in_specs=P("i"), out_specs=P())        # doctest: +SKIP
    """
    return _reduce(x, axis_name, "sum", axis_index_groups, codec)


def pmean(x: Any, axis_name, *, axis_index_groups=None, codec: str = "none",
          weight=None) -> Any:
    """Averages a pytree over the named axes, like ``jax.lax.pmean``.

    Floating values are divided on the server, off the accelerator; integers
    give a floating mean, as ``jax.lax.pmean`` does.

    ``weight`` (herring_jax only): this device's weight, a real scalar (e.g.
    the tokens of its batch): the result is ``sum_i(w_i x_i) / sum_i(w_i)``
    over the devices of the axes, with the arithmetic and the rules for zero
    and bad weights of ``herring_jax.allreduce(..., op="mean", weight=w)``;
    floating leaves only. A weight that is the same on every device counts
    once per device.

    Examples:
      >>> f = jax.shard_map(lambda g, n: herring_jax.pmean(g, "i", weight=n[0]),
      ...                   mesh=mesh, in_specs=(P("i"), P("i")), out_specs=P())  # doctest: +SKIP
    """
    return _reduce(x, axis_name, "mean", axis_index_groups, codec, weight)


def pmax(x: Any, axis_name, *, axis_index_groups=None) -> Any:
    """The maximum of a pytree over the named axes, like ``jax.lax.pmax``.

    Where ``jax.lax.pmax`` can be used (``jax.shard_map`` with or without
    ``check_vma``, ``jax.pmap``, an axis bound by ``jax.vmap``, which is
    reduced in place), with its signature and types; ``axis_index_groups``
    also with ``check_vma=True``, as in lax. NaN wins (as XLA's maximum); bool
    stays bool (a logical or). Not differentiable, as ``jax.lax.pmax``:
    ``jax.grad`` through it raises NotImplementedError. Complex values raise
    TypeError (they have no order; lax fails on them when it runs).

    Args:
      x: a pytree of arrays (float16/32/64, bfloat16, (u)int8/16/32/64, bool).
      axis_name: an axis name or a tuple of names.
      axis_index_groups: optional list of lists of axis indices.

    Returns:
      The pytree of maxima, the same on every device of the reduced axes.

    Examples:
      >>> f = jax.shard_map(lambda loss: herring_jax.pmax(loss, "i"), mesh=mesh,
      ...                   in_specs=P("i"), out_specs=P())        # doctest: +SKIP
    """
    return _reduce(x, axis_name, "max", axis_index_groups)


def pmin(x: Any, axis_name, *, axis_index_groups=None) -> Any:
    """The minimum of a pytree over the named axes, like ``jax.lax.pmin``; as
    ``herring_jax.pmax`` otherwise (bool: a logical and)."""
    return _reduce(x, axis_name, "min", axis_index_groups)
