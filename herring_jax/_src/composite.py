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
does) and the function that transposes it. The body must be linear in its
operands (a sum, a gather, moves of data): its JVP is the body applied to
the tangents, its transpose is the given function. Lowering inlines the
body; under ``jax.vmap`` the body is batched in place (the vmapped program
then holds its pieces, each batched as lax's).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, mlir

from herring_jax._src import jax_compat


class _Collective(jex_core.Primitive):
    """A primitive whose str() is the lax collective it stands in for."""

    def __init__(self, label: str):
        super().__init__(f"herring_{label}")
        self.label = label

    def __str__(self) -> str:
        return self.label


_PRIMITIVES: dict[str, _Collective] = {}


def bind(label: str, body: Callable, operands, transpose: Callable | None = None) -> list:
    """``body(*operands)`` (a list of arrays) as one equation of the
    collective `label`.

    `transpose(cotangents, operand_avals, known)` gives the operands'
    cotangents (arrays, or None for a zero) from the results' cotangents
    (arrays; a symbolic zero comes as zeros); `known` holds the values of the
    operands that are not transposed (None for those that are). None: the
    body's own transpose (jax's transposition of its equations,
    herring_allreduce's rules included).
    """
    operands = list(operands)
    if transpose is None:
        transpose = functools.partial(_transpose_body, body)
    closed = jax.make_jaxpr(lambda *xs: list(body(*xs)))(*operands)
    return _primitive(label).bind(*operands, jaxpr=closed, transpose=transpose)


def _primitive(label: str) -> _Collective:
    p = _PRIMITIVES.get(label)
    if p is None:
        p = _PRIMITIVES[label] = _register(_Collective(label))
    return p


def _register(p: _Collective) -> _Collective:
    p.multiple_results = True

    def abstract_eval(*avals, jaxpr, transpose):
        del avals, transpose
        return list(jaxpr.out_avals)

    def impl(*args, jaxpr, transpose):
        del transpose
        return jex_core.jaxpr_as_fun(jaxpr)(*args)

    def lower(ctx, *args, jaxpr, transpose):
        del transpose
        return mlir.lower_fun(jex_core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)

    def jvp(primals, tangents, *, jaxpr, transpose):
        outs = p.bind(*primals, jaxpr=jaxpr, transpose=transpose)
        if all(type(t) is ad.Zero for t in tangents):
            return outs, [jax_compat.zero_tangent(o) for o in outs]
        # Integer operands have no tangent: zeros of their own type stand in,
        # and integer results get symbolic zeros.
        tangents = [_zeros(jax.typeof(x)) if type(t) is ad.Zero or not _inexact(jax.typeof(x))
                    else t for x, t in zip(primals, tangents)]
        touts = p.bind(*tangents, jaxpr=jaxpr, transpose=transpose)
        return outs, [t if _inexact(jax.typeof(o)) else jax_compat.zero_tangent(o)
                      for o, t in zip(outs, touts)]

    def transpose_rule(cts, *args, jaxpr, transpose):
        del jaxpr
        avals = [a.aval if ad.is_undefined_primal(a) else jax.typeof(a) for a in args]
        if all(type(c) is ad.Zero for c in cts):
            return [ad.Zero(a) if ad.is_undefined_primal(x) else None
                    for x, a in zip(args, avals)]
        cts = [_zeros(c.aval) if type(c) is ad.Zero else c for c in cts]
        known = [None if ad.is_undefined_primal(a) else a for a in args]
        outs = transpose(cts, avals, known)
        return [None if not ad.is_undefined_primal(x) else
                (ad.Zero(a) if o is None else o) for x, a, o in zip(args, avals, outs)]

    def batch(axis_data, args, dims, *, jaxpr, transpose):
        del transpose
        fun = jex_core.jaxpr_as_fun(jaxpr)
        outs = jax.vmap(lambda *xs: fun(*xs), in_axes=tuple(dims), out_axes=0,
                        axis_name=axis_data.name, axis_size=axis_data.size,
                        spmd_axis_name=getattr(axis_data, "spmd_name", None))(*args)
        return list(outs), [0] * len(outs)

    p.def_abstract_eval(abstract_eval)
    p.def_impl(impl)
    for platform in ("cpu", "cuda"):
        mlir.register_lowering(p, lower, platform=platform, cacheable=False)
    ad.primitive_jvps[p] = jvp
    ad.primitive_transposes[p] = transpose_rule
    jax_compat.register_named_batcher(p, batch)
    return p


def _transpose_body(body, cts, avals, known):
    del known
    operands = [_zeros(a) for a in avals]
    return list(jax.linear_transpose(lambda *xs: list(body(*xs)), *operands)(list(cts)))


def _inexact(aval) -> bool:
    return bool(np.issubdtype(aval.dtype, np.inexact)) or aval.dtype == jax.numpy.bfloat16


def _zeros(aval):
    return jax_compat.zeros_of(aval)
