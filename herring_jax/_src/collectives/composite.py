"""A collective made of several equations, seen by jax as one.

herring's collectives are herring_allreduce plus moves and reshapes of axes
around it (psum_scatter.py), or plus the cutting of a gathered fusion buffer
into leaves (fully_sharded.py). Whatever looks at single equations would see
the pieces: a remat policy such as JAX's FSDP recipe's
``lambda prim, *_, **__: str(prim) != 'all_gather'`` would let the whole
gathered weights be saved (as the output of the reshape after the gather),
and ``print_saved_residuals`` would show them. So each such collective is
bound as one equation of a primitive whose ``str()`` is lax's name of the
collective (``all_gather``, ``reduce_scatter``): policies treat herring's
as lax's, while jaxprs print herring's own name (``herring_all_gather``).

The equation holds the traced body (a ClosedJaxpr, as ``jit``'s equation
does) and the function that transposes it. The body is linear in its
operands (a sum, a gather, moves of data): its JVP is the body applied to
the tangents, its transpose is the given function; or, for a max or min, it
has a JVP rule of its own (which refuses). Some operands may be values that
the transpose reads and nobody differentiates (`nondiff`: an error
feedback's residual, added to the cotangents before they are compressed):
the JVP passes their values, not their tangents, to the tangent equation,
so that its transpose finds them among the known operands (zeros of their
tangents would stand there otherwise, and the residual would be lost).
Lowering inlines the body; under ``jax.vmap`` the body is batched in place
(the vmapped program then holds its pieces, each batched as lax's), each
result keeping the batch dimension the body's batching gives it (none for a
gather over the vmapped axis, as lax's).

While split.split_reductions traces (allreduce_gradients' buckets), the
body is bound in place instead: the split pairs each reduction with its
start as it is bound, which it cannot do inside a nested trace.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from herring_jax._src.collectives import allreduce as _allreduce
from herring_jax._src.process import jax_compat


class _Collective(jex_core.Primitive):
    """A primitive whose str() is the lax collective it stands in for."""

    def __init__(self, label: str, name: str | None = None):
        super().__init__(name or f"herring_{label}")
        self.label = label

    def __str__(self) -> str:
        return self.label


_PRIMITIVES: dict[str, _Collective] = {}


def bind(label: str, body: Callable, operands, transpose: Callable | None = None,
         jvp: Callable | None = None, nondiff: tuple[int, ...] = (),
         name: str | None = None) -> list:
    """``body(*operands)`` (a list of arrays) as one equation of the
    collective `label`.

    `transpose(cotangents, operand_avals, known)` gives the operands'
    cotangents (arrays, or None for a zero) from the results' cotangents
    (arrays; a symbolic zero comes as zeros); `known` holds the values of the
    operands that are not transposed (None for those that are). None: the
    body's own transpose (jax's transposition of its equations,
    herring_allreduce's rules included).
    `jvp(primals, tangents)`: for a body that is not linear, its JVP rule
    (tangents as jax gives them, symbolic zeros included); None: linear.
    `nondiff`: the positions of operands taken as constants: their tangents
    are ignored (the body must be linear in the other operands for fixed
    values of these), and `transpose` always finds their values in `known`
    and gives them no cotangent (None). The transpose then runs even where
    every result's cotangent is zero, since it may act on these values
    alone.
    `name`: the primitive's name in jaxprs (default ``herring_<label>``).
    """
    operands = list(operands)
    nondiff = tuple(sorted(set(nondiff)))
    if any(not 0 <= i < len(operands) for i in nondiff):
        raise ValueError(f"composite.bind: nondiff positions {nondiff} outside the "
                         f"{len(operands)} operands")
    if _allreduce._receiver.current is not None:
        return list(body(*operands))
    closed = jax.make_jaxpr(lambda *xs: list(body(*xs)))(*operands)
    return _primitive(label, name).bind(*operands, jaxpr=closed, transpose=transpose, jvp=jvp,
                                        nondiff=nondiff)


def _primitive(label: str, name: str | None = None) -> _Collective:
    name = name or f"herring_{label}"
    p = _PRIMITIVES.get(name)
    if p is None:
        p = _PRIMITIVES[name] = _register(_Collective(label, name))
    return p


def _register(p: _Collective) -> _Collective:
    p.multiple_results = True

    def abstract_eval(*avals, jaxpr, transpose, jvp, nondiff):
        del avals, transpose, jvp, nondiff
        return list(jaxpr.out_avals)

    def impl(*args, jaxpr, transpose, jvp, nondiff):
        del transpose, jvp, nondiff
        return jex_core.jaxpr_as_fun(jaxpr)(*args)

    def lower(ctx, *args, jaxpr, transpose, jvp, nondiff):
        del transpose, jvp, nondiff
        return mlir.lower_fun(jex_core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)

    def jvp_rule(primals, tangents, *, jaxpr, transpose, jvp, nondiff):
        if jvp is not None:
            return jvp(primals, tangents)
        params = dict(jaxpr=jaxpr, transpose=transpose, jvp=jvp, nondiff=nondiff)
        outs = p.bind(*primals, **params)
        if all(type(t) is ad.Zero for i, t in enumerate(tangents) if i not in nondiff):
            return outs, [jax_compat.zero_tangent(o) for o in outs]
        # The constants go in as their values (the transpose reads them).
        # Integer operands have no tangent: zeros of their own type stand in,
        # and integer results get symbolic zeros.
        tangents = [x if i in nondiff else
                    _zeros(jax.typeof(x)) if type(t) is ad.Zero or not _inexact(jax.typeof(x))
                    else t for i, (x, t) in enumerate(zip(primals, tangents))]
        touts = p.bind(*tangents, **params)
        return outs, [t if _inexact(jax.typeof(o)) else jax_compat.zero_tangent(o)
                      for o, t in zip(outs, touts)]

    def transpose_rule(cts, *args, jaxpr, transpose, jvp, nondiff):
        del jvp
        # The operands' own types, as traced: jax may give an undefined
        # operand the type of its cotangent instead (reduced for an unreduced
        # operand), and the body's transpose must see what it was traced on.
        avals = list(jaxpr.in_avals)
        if all(type(c) is ad.Zero for c in cts) and not nondiff:
            return [ad.Zero(x.aval) if ad.is_undefined_primal(x) else None for x in args]
        known = [None if ad.is_undefined_primal(a) else a for a in args]
        if transpose is None:
            # The traced body's equations transposed in place: the transposed
            # program holds only their transposes (what lax's would hold), and
            # jax checks each cotangent against the type of the value it
            # belongs to (a result reduced over another axis gets one unreduced
            # over it).
            outs = jax_compat.transpose_jaxpr(jaxpr, known, cts)
        else:
            cts = [_zeros(c.aval) if type(c) is ad.Zero else c for c in cts]
            outs = transpose(cts, avals, known)
        return [None if not ad.is_undefined_primal(x) else
                (ad.Zero(x.aval) if o is None else o) for x, o in zip(args, outs)]

    def batch(axis_data, args, dims, *, jaxpr, transpose, jvp, nondiff):
        del transpose, jvp, nondiff
        # Each output keeps the batch dimension the body's own batching gives
        # it: a gather over the vmapped axis is unbatched (as lax's), so that
        # vmap(..., out_axes=None) takes it.
        batched, out_dims = jax_compat.batch_jaxpr(jaxpr, axis_data, dims)
        return list(jex_core.jaxpr_as_fun(batched)(*args)), list(out_dims)

    p.def_abstract_eval(abstract_eval)
    p.def_impl(impl)
    for platform in ("cpu", "cuda"):
        mlir.register_lowering(p, lower, platform=platform, cacheable=False)
    ad.primitive_jvps[p] = jvp_rule
    ad.primitive_transposes[p] = transpose_rule
    jax_compat.register_named_batcher(p, batch)
    return p


def inexact(aval) -> bool:
    """Whether values of `aval` have tangents (floating or complex)."""
    return _inexact(aval)


def _inexact(aval) -> bool:
    return bool(np.issubdtype(aval.dtype, np.inexact)) or aval.dtype == jax.numpy.bfloat16


def _zeros(aval):
    return jax_compat.zeros_of(aval)


# -- inside a body only: an unreduced operand taken as varying ----------------
# lax's psum_scatter of an operand unreduced over the axes (jax's FSDP form:
# the cotangent of a gather to='reduced') reduce-scatters each device's
# partial sum. herring's reduce-scatter takes varying operands, and no jax
# cast turns unreduced into varying (it has no transpose of its own), so a
# body marks them so with this identity; the composite around it is what
# jax differentiates and transposes.

unreduced_as_varying_p = jex_core.Primitive("herring_unreduced_as_varying")


def unreduced_as_varying(x, axes):
    if not jax_compat.check_vma_enabled() or not jax_compat.is_unreduced(jax.typeof(x), axes):
        return x
    return unreduced_as_varying_p.bind(x, axes=tuple(axes))


def _cast_batch(args, dims, *, axes):
    (x,), (d,) = args, dims
    return unreduced_as_varying_p.bind(x, axes=axes), d


unreduced_as_varying_p.def_abstract_eval(lambda aval, *, axes: jax_compat.unreduced_as_varying(
    aval, axes))
unreduced_as_varying_p.def_impl(lambda x, *, axes: x)
mlir.register_lowering(unreduced_as_varying_p, lambda ctx, x, *, axes: [x])
batching.primitive_batchers[unreduced_as_varying_p] = _cast_batch
