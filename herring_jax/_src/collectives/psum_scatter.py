"""herring_jax.psum_scatter / all_gather: drop-ins for jax.lax's inside
jax.shard_map (with or without check_vma) and jax.pmap, run by the Herring
engine as the two halves of its reduction: a reduce-scatter is the sum that
each server takes of its part, an all-gather the sending back of the parts.

Both are herring_allreduce (allreduce.py) with collective "reduce_scatter" or
"all_gather", whose blocks are the leading dimension of a contiguous array:
the scatter dimension is moved to the front (split into (G, size / G) when
tiled) before, and the gathered one moved into place after. The moves are
free where the dimension is 0 (a tiled one is merely reshaped); elsewhere XLA
copies the array once. Transposes, vmap and the varying-axis types follow
lax: psum_scatter and all_gather transpose to each other with the same
dimension, tiling and groups.

Where lax and herring differ, by design: sums are taken in herring's fixed
order (local devices, then the processes of a host by rank, then the hosts),
so floating results are bitwise reproducible and bitwise equal to the same
elements of herring_jax.psum's result, but may differ from XLA's own
reduce-scatter in the last bits.

jax's newer FSDP forms are lax's too: all_gather(..., to='reduced') (the
gathered weights typed the same on every device, their cotangent unreduced)
transposes to a psum_scatter of that unreduced cotangent, and psum_scatter of
an operand unreduced over the axes scatters each device's partial sums (as
lax's unreduced_reduce_scatter) and transposes to the gather to='reduced'.
Each call is one equation whose str() is lax's primitive's name
(reduce_scatter, unreduced_reduce_scatter, all_gather, all_gather_invariant,
all_gather_reduced; composite.py), so remat policies treat them as lax's.

Not supported (each raises, saying what to do instead): axis_index_groups
with to='invarying' or 'reduced', or with an unreduced operand (as in lax),
both over an axis bound by jax.vmap together with mesh axes (as in lax),
and axis_index_groups over a vmapped axis (as in lax). On XLA:CUDA they lower
to the start/done pair of the all-reduce (lowering.py), not yet verified on a
GPU (docs/guides/gpus.md).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from herring_jax._src.collectives import allreduce as _allreduce
from herring_jax._src.collectives import codecs
from herring_jax._src.collectives import composite
from herring_jax._src.process import jax_compat
from herring_jax._src.process import layout
from herring_jax._src.collectives.codecs import BLOCK as BLOCK_ELEMENTS
from herring_jax._src.collectives.psum import _groups as _psum_groups


def _axes(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _groups(axis_index_groups, api: str):
    """lax's checks of axis_index_groups (psum's); the groups must also be of
    one size (lax says so for these two and fails otherwise)."""
    groups = _psum_groups(axis_index_groups)
    if groups is not None and len({len(g) for g in groups}) != 1:
        raise ValueError(f"{api}: all axis_index_groups must be the same size, got "
                         f"{[len(g) for g in groups]}")
    return groups


def _check_dimension(api: str, what: str, d, ndim: int, name: str) -> int:
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
        raise TypeError(f"{api}: {what} must be an int, got {d!r}")
    if not -ndim <= d < ndim:
        raise np.exceptions.AxisError(
            f"{api}: {what}={d} is out of bounds for {name}, which has {ndim} dimension(s) "
            "here (inside the map, per device)")
    return int(d) % ndim if ndim else 0


def _setup(x, axis_name, axis_index_groups, api):
    """(axes, groups, G, leaves, names, treedef), or None where there is
    nothing to do (no axis left; an empty tree)."""
    axes = jax_compat.skip_one_sized_axes(_axes(axis_name))
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if not axes or not leaves:
        return None
    if any(isinstance(a, int) for a in axes):
        raise TypeError(f"{api} works over named axes only, got {axes}")
    groups = _groups(axis_index_groups, api)
    # lax's NameError (its text where it asks the axis's size), while
    # tracing, for an axis nothing binds.
    jax_compat.check_axis_names(axes, api, like="axis_size")
    size = layout.group_size(axes, groups)
    return axes, groups, size, leaves, _allreduce.leaf_names(x), treedef


def psum_scatter(x: Any, axis_name, *, scatter_dimension: int = 0, axis_index_groups=None,
                 tiled: bool = False, codec: str = "none") -> Any:
    """Sums a pytree over the named axes and leaves each device its part, like
    ``jax.lax.psum_scatter``: "the first half" of ``herring_jax.psum``.

    Use inside ``jax.shard_map`` (with or without ``check_vma``) or
    ``jax.pmap``; an axis bound by ``jax.vmap(..., axis_name=...)`` alone is
    scattered in place, as in lax. Device i of a group (``lax.axis_index`` over
    the axes, or its place in its ``axis_index_groups`` group) gets block i of
    the sum along ``scatter_dimension``: with ``tiled=False`` that dimension
    must equal the group size G and is removed; with ``tiled=True`` it must be
    divisible by G and is divided by it. Differentiable (its transpose is
    ``all_gather`` with the same dimension, tiling and groups), batchable and
    typed (varying axes) as lax's. bool is refused, as by lax. An operand
    unreduced over the axes (jax's FSDP form: the cotangent of a gather
    ``to="reduced"``) is scattered as each device's partial sums, as lax
    does; its transpose is then that gather.

    Args:
      x: a pytree of arrays (float16/32/64, bfloat16, complex64/128,
        (u)int8/16/32/64).
      axis_name: an axis name or a tuple of names.
      scatter_dimension: the dimension to scatter (>= 0, as lax lowers).
      axis_index_groups: optional list of lists of axis indices, all of one
        size.
      tiled: keep the dimension (divided by G) rather than remove it.
      codec: herring_jax only: how float32 leaves cross between processes
        (``"none"``, ``"bf16"``, ``"fp16"``, ``"int8"``; see
        ``herring_jax.allreduce``); a compressed leaf's block (its result's
        size) must be a multiple of 256 elements.

    Returns:
      The pytree of this device's blocks of the sums.

    Raises:
      ValueError: the scatter dimension does not fit the group size, is
        negative on jax 0.10 (as lax there; jax 0.12 counts it from the end),
        or a codec's block is not a multiple of 256.
      TypeError: bool or unsupported dtype. NameError: unbound axis (lax's
        text first).
      NotImplementedError: axis_index_groups with an unreduced operand, or
        see the module notes.

    Examples:
      >>> mesh = jax.make_mesh((4,), ("i",))                       # doctest: +SKIP
      >>> f = jax.shard_map(lambda g: herring_jax.psum_scatter(g, "i", tiled=True),
      ...                   mesh=mesh, in_specs=P(), out_specs=P("i"))  # doctest: +SKIP
      >>> f(jnp.ones(8))   # each device: its 2 elements of the sum  # doctest: +SKIP
      Array([4., 4., 4., 4., 4., 4., 4., 4.], dtype=float32)
    """
    api = "herring_jax.psum_scatter"
    codecs.check_codec(codec)
    setup = _setup(x, axis_name, axis_index_groups, api)
    if setup is None:
        return x
    axes, groups, size, leaves, names, treedef = setup
    operands, dims, unreduced = [], [], []
    for name, v in zip(names, leaves):
        if _allreduce.is_bool(v):
            raise TypeError(f"{api}: {name} is bool, which jax.lax.psum_scatter does not sum "
                            "either; cast it first, e.g. x.astype(jnp.int32)")
        v = _allreduce.prepare_leaf(name, v)
        d = _scatter_dimension(api, scatter_dimension, v, name)
        n = v.shape[d]
        if tiled and n % size:
            raise ValueError(
                f"{api}: tiled scatter dimension {d} of {name} has size {n}, which must be "
                f"divisible by the group size {size} (the devices of {axes}"
                f"{' in each group' if groups else ''}); pad it to a multiple of {size}")
        if not tiled and n != size:
            raise ValueError(
                f"{api}: scatter dimension {d} of {name} has size {n}, which must equal the "
                f"group size {size} (the devices of {axes}{' in each group' if groups else ''})"
                f"; use tiled=True to scatter a dimension that is a multiple of {size}")
        unreduced.append(_unreduced(v, axes, groups, api))
        if not unreduced[-1]:
            v = _vary(v, axes, api)
        if size > 1:
            _check_codec_block(api, name, v, codec, v.size // size)
        operands.append(v)
        dims.append(d)

    def scatter(*vs, dims):
        moved, shapes = [], []
        for v, d in zip(vs, dims):
            v = composite.unreduced_as_varying(v, axes)
            if tiled:
                v = v.reshape(v.shape[:d] + (size, v.shape[d] // size) + v.shape[d + 1:])
            moved.append(jnp.moveaxis(v, d, 0))
            shapes.append(v.shape[:d] + v.shape[d + 1:])
        outs = _allreduce.bind_grouped(moved, ops=["sum"] * len(moved), codec=codec, axes=axes,
                                       groups=groups, collective="reduce_scatter")
        return [o.reshape(shape) for o, shape in zip(outs, shapes)]

    def gather_reduced(cts, avals, known, dims):
        del known
        # lax's transpose of its unreduced_reduce_scatter: the cotangents,
        # varying over the axes, gathered to='reduced' (the type of an
        # unreduced operand's cotangent).
        return [all_gather(ct, axes, axis=d, tiled=tiled, to="reduced")
                for ct, d in zip(cts, dims)]

    # One equation per kind of operand, each seen by remat policies as lax's
    # (reduce_scatter, unreduced_reduce_scatter; composite.py says why).
    outs = [None] * len(operands)
    for kind in (False, True):
        idx = [i for i, u in enumerate(unreduced) if u == kind]
        if not idx:
            continue
        kind_dims = [dims[i] for i in idx]
        results = composite.bind(
            "unreduced_reduce_scatter" if kind else "reduce_scatter",
            functools.partial(scatter, dims=kind_dims), [operands[i] for i in idx],
            functools.partial(gather_reduced, dims=kind_dims) if kind else None)
        for i, r in zip(idx, results):
            outs[i] = r
    return jax.tree_util.tree_unflatten(treedef, outs)


def _unreduced(v, axes, groups, api) -> bool:
    """Whether lax would scatter `v` as partial sums (unreduced over the axes,
    where shard_map checks varying axes): jax's FSDP form, the cotangent of a
    gather to='reduced'."""
    if not jax_compat.check_vma_enabled():
        return False
    if jax_compat.axis_state(jax.typeof(v), axes, api) != "unreduced":
        return False
    if groups is not None:
        raise NotImplementedError(f"{api} of an operand unreduced over {axes} takes no "
                                  "axis_index_groups (nor does jax.lax.psum_scatter)")
    return True


def _scatter_dimension(api, d, v, name) -> int:
    if (isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d < 0
            and not jax_compat.negative_scatter_dimension()):
        # jax 0.10 traces it and then fails to lower it ("attribute
        # 'scatter_dimension' failed to satisfy constraint ... non-negative").
        raise ValueError(f"{api}: scatter_dimension={d} is negative, which jax.lax.psum_scatter "
                         f"cannot lower either; pass {d} + x.ndim = {d + v.ndim} for {name}")
    # Counts a negative one from the end, as jax 0.12's lax (numpy's rule).
    return _check_dimension(api, "scatter_dimension", d, v.ndim, name)


def _check_codec_block(api, name, v, codec, block):
    if (codec != "none" and _allreduce.leaf_codec(v, codec) != "none"
            and block % BLOCK_ELEMENTS):
        raise ValueError(
            f"{api}: {name}'s block has {block} elements; codec {codec!r} needs blocks of a "
            f"multiple of {BLOCK_ELEMENTS} (its encoding's block), so that every part starts "
            "on one. Pad the scattered dimension, or use codec='none' for this leaf")


def _vary(v, axes, api):
    """The operand as lax takes it where shard_map checks varying axes: a value
    the same on every device is marked varying first (as lax); a reduced one
    is refused (as lax)."""
    if not jax_compat.check_vma_enabled():
        return v
    aval = jax.typeof(v)
    state = jax_compat.axis_state(aval, axes, api)
    if state == "reduced":
        raise ValueError(f"{api} cannot accept args which are reduced. Got "
                         f"{aval.str_short(True)} and axes={set(axes)}")
    if state == "invarying" and not jax_compat.auto_pcast_enabled():
        raise ValueError(f"{api} must be applied to a value that varies over {axes}; got "
                         f"{aval.str_short(True)}: mark it varying first with "
                         "jax.lax.pcast(x, axes, to='varying')")
    return jax_compat.vary_over(v, axes)


def _check_gather_reduced(api, aval, axes):
    """lax's checks of all_gather(..., to='reduced') (all_gather_reduced)."""
    if jax_compat.is_reduced(aval, axes):
        raise ValueError(f"{api}(..., to='reduced')'s input cannot be reduced across the "
                         f"axis_name provided (nor can jax.lax.all_gather's). Got "
                         f"{aval.str_short(True)} and axis_name={axes}")
    if not jax_compat.is_varying(aval, axes):
        raise ValueError(
            f"{api}(..., to='reduced') is a Varying -> Reduced collective, as in lax: the "
            f"axes {axes} must be among the input's varying axes ({aval.str_short(True)}); "
            "gather a value that is the same on every device with to='invarying'")


def all_gather(x: Any, axis_name, *, axis_index_groups=None, axis: int = 0, tiled: bool = False,
               to: str = "varying") -> Any:
    """Gathers a pytree from every device of the named axes, like
    ``jax.lax.all_gather``: "the second half" of ``herring_jax.psum``.

    Use inside ``jax.shard_map`` (with or without ``check_vma``) or
    ``jax.pmap``; an axis bound by ``jax.vmap(..., axis_name=...)`` alone is
    gathered in place, as in lax. Device i of a group's value is block i of
    the result: with ``tiled=False`` in a new dimension ``axis`` of size G
    (the group size); with ``tiled=True`` concatenated along the existing
    dimension ``axis``. Negative ``axis`` counts from the end, as in lax.
    Differentiable (its transpose is ``psum_scatter`` with the same
    dimension, tiling and groups), batchable and typed (varying axes) as
    lax's; every dtype psum takes, and bool (gathered as uint8). Exact: every
    device gets bitwise the values sent. ``to="invarying"`` (lax's
    ``all_gather_invariant``) types the result as the same on every device
    of the axes; its transpose then takes each device's block of the
    cotangent, with no traffic. ``to="reduced"`` (jax's FSDP form) types it
    as reduced over the axes (the same on every device, its cotangent
    unreduced): its transpose reduce-scatters that unreduced cotangent, so
    that each device gets its block of the summed gradient.

    Args:
      x: a pytree of arrays.
      axis_name: an axis name or a tuple of names.
      axis_index_groups: optional list of lists of axis indices, all of one
        size.
      axis: where the gathered blocks go.
      tiled: concatenate along ``axis`` rather than stack in a new one.
      to: ``"varying"`` (lax's default), ``"invarying"`` or ``"reduced"``
        (inside ``jax.shard_map`` with ``check_vma``, as lax).

    Returns:
      The pytree of gathered arrays.

    Raises:
      ValueError: an unknown ``to``, an unreduced operand, ``to="reduced"``
        of a value that does not vary over the axes (as lax). NameError:
        unbound axis (lax's text first). NotImplementedError:
        axis_index_groups with ``to="invarying"`` or ``"reduced"`` (as lax).

    Examples:
      >>> f = jax.shard_map(lambda p: herring_jax.all_gather(p, "i", tiled=True),
      ...                   mesh=mesh, in_specs=P("i"), out_specs=P("i"))  # doctest: +SKIP
    """
    api = "herring_jax.all_gather"
    if to not in ("varying", "invarying", "reduced"):
        raise ValueError(f"Got unexpected `to` value {to!r} for `{api}`. Allowed `to` values "
                         "are: 'varying', 'invarying', 'reduced'")
    if to != "varying" and axis_index_groups is not None:
        raise NotImplementedError(f"{api}(..., to={to!r}) takes no axis_index_groups "
                                  "(nor does jax.lax.all_gather)")
    setup = _setup(x, axis_name, axis_index_groups, api)
    if setup is None:
        return x
    axes, groups, size, leaves, names, treedef = setup
    operands, was_bool, dims = [], [], []
    for name, v in zip(names, leaves):
        was_bool.append(_allreduce.is_bool(v))
        v = _allreduce.prepare_leaf(name, v, np.uint8)
        dims.append(_check_dimension(api, "axis", axis, v.ndim if tiled else v.ndim + 1, name))
        if jax_compat.check_vma_enabled():
            aval = jax.typeof(v)
            if jax_compat.is_unreduced(aval, axes):
                raise ValueError(f"{api} cannot accept args which are unreduced (nor can "
                                 f"jax.lax.all_gather); got {aval.str_short(True)}: reduce "
                                 "them first with herring_jax.psum or psum_scatter")
            if to == "reduced":
                _check_gather_reduced(api, aval, axes)
            v = jax_compat.vary_over(v, axes)
        elif to == "reduced":
            raise ValueError(
                f"{api}(..., to='reduced') only accepts inputs that are varying (as "
                f"jax.lax.all_gather), which needs jax.shard_map's varying-axis checks: "
                f"call it inside jax.shard_map(..., check_vma=True), or gather to='varying'")
        operands.append(v)
    # As lax: without shard_map's checks, jax 0.12's invariant all-gather is a
    # plain one (its transpose sums the cotangents).
    invariant = to == "reduced" or to == "invarying" and (
        jax_compat.check_vma_enabled() or not jax_compat.invariant_gather_needs_check_vma())
    collective = "all_gather_invariant" if invariant else "all_gather"

    def gather(*vs):
        outs = _allreduce.bind(list(vs), op="sum", axes=axes, groups=groups,
                               collective=collective)
        results = []
        for o, v, d in zip(outs, vs, dims):
            o = jnp.moveaxis(o, 0, d)
            if tiled:
                o = o.reshape(v.shape[:d] + (size * v.shape[d],) + v.shape[d + 1:])
            if to == "reduced":
                # The gather to 'invarying' then the cast lax's own type rule
                # amounts to: the same on every device, its cotangent unreduced.
                o = jax_compat.preduced(o, axes)
            results.append(o)
        return results

    def scatter_unreduced(cts, avals, known):
        del known
        # lax's transpose of all_gather_reduced: the unreduced cotangents
        # reduce-scattered back to each device's block (not lax.preduced's
        # transpose, an all-reduce, and then a slice).
        return [psum_scatter(ct, axes, scatter_dimension=d, tiled=tiled)
                if composite.inexact(a) else None for ct, a, d in zip(cts, avals, dims)]

    # One equation that remat policies see as lax's all_gather (or
    # all_gather_invariant, all_gather_reduced), its result already in place
    # (composite.py says why).
    label = {"varying": collective, "invarying": collective, "reduced": "all_gather_reduced"}[to]
    results = composite.bind(label, gather, operands,
                             scatter_unreduced if to == "reduced" else None)
    results = [o.astype(np.bool_) if b else o for o, b in zip(results, was_bool)]
    return jax.tree_util.tree_unflatten(treedef, results)
