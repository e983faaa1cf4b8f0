"""reshard_after_forward's loss: what is derived from gathered parameters
alone is recomputed in the backward pass, never saved.

fully_sharded's reshard_after_forward runs the loss under ``jax.checkpoint``
with a policy that saves every value but the gathers' outputs (which are
gathered again in the backward pass). A policy sees one equation at a time,
not where its operands come from, so a value computed from a gathered weight
(a cast of a bfloat16 weight to float32, a transpose) would be saved whole:
more than the parameter itself. So the loss is traced and evaluated equation
by equation here, and each equation whose operands are all gathered
parameters or values derived from them (and literals) is bound as a
composite (composite.py) whose ``str()`` is ``all_gather``: the policy
treats it as part of the gather, and the backward pass recomputes it from
the gathered bucket. Its JVP is evaluated the same way, so the values that
the tangents need (the cosine of a parameter, for its sine) are recomputed
too; only values that also depend on the batch are saved.

Nested ``jax.jit`` calls are inlined (a transpose inside ``jnp.einsum``'s jit
is derived too); other higher-order equations (custom_jvp functions, loops)
are bound as they are, their results saved if the backward pass needs them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad

from herring_jax._src.collectives import composite
from herring_jax._src.process import jax_compat

# A composite's name in jaxprs; str() is "all_gather" for remat policies.
LABEL = "all_gather"
NAME = "herring_from_gather"


def evaluate(fun: Callable, params: Sequence, args: tuple):
    """``fun(params, *args)``, with every equation derived from `params`
    alone bound as a composite that the remat policy recomputes. `params` is
    a flat list of arrays."""
    closed, shape = jax.make_jaxpr(lambda p: fun(p, *args), return_shape=True)(list(params))
    outs, _ = _eval(closed.jaxpr, closed.consts, list(params), [True] * len(params))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outs)


def _eval(jaxpr, consts, args, derived_in) -> tuple[list, list]:
    """The outputs of `jaxpr`, and whether each is derived from the
    arguments marked in `derived_in` alone."""
    env: dict = {}
    derived: set = set()

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x, d in zip(jaxpr.invars, args, derived_in):
        env[v] = x
        if d:
            derived.add(v)
    for eqn in jaxpr.eqns:
        vars_in = [v for v in eqn.invars if not isinstance(v, jex_core.Literal)]
        from_gather = bool(vars_in) and all(v in derived for v in vars_in)
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive.name in ("jit", "pjit") and isinstance(eqn.params.get("jaxpr"),
                                                                jex_core.ClosedJaxpr):
            # A nested jit: its equations one by one, as if written here.
            inner = eqn.params["jaxpr"]
            outs, outs_derived = _eval(inner.jaxpr, inner.consts, invals,
                                       [not isinstance(v, jex_core.Literal) and v in derived
                                        for v in eqn.invars])
        elif from_gather and _wrappable(eqn):
            outs = _wrap(eqn, invals)
            outs_derived = [True] * len(outs)
        else:
            outs = _bind(eqn.primitive, invals, eqn.params)
            outs_derived = [False] * len(outs)
        for v, x, d in zip(eqn.outvars, outs, outs_derived):
            env[v] = x
            if d:
                derived.add(v)
    return ([read(v) for v in jaxpr.outvars],
            [not isinstance(v, jex_core.Literal) and v in derived for v in jaxpr.outvars])


def _bind(prim, invals, params) -> list:
    """An equation's primitive bound again (as jax.core.eval_jaxpr does),
    its results as a list."""
    bind_params = prim.get_bind_params(params)
    # Older jax gave (subfuns, params); jax 0.10 gives the params alone.
    subfuns, bind_params = bind_params if isinstance(bind_params, tuple) else ((), bind_params)
    out = prim.bind(*subfuns, *invals, **bind_params)
    return list(out) if prim.multiple_results else [out]


def _wrappable(eqn) -> bool:
    """A first-order equation (no jaxpr inside) between floating arrays."""
    if list(jex_core.jaxprs_in_params(eqn.params)):
        return False
    return all(composite.inexact(v.aval) for v in [*eqn.invars, *eqn.outvars]
               if isinstance(v, jex_core.Var))


def _wrap(eqn, invals) -> list:
    """One equation as a composite: its value, and a JVP that evaluates
    jax's JVP of it with the primal-only equations wrapped again."""
    prim, params = eqn.primitive, eqn.params
    # Literal operands stay in the body; the others are its operands.
    at = [k for k, v in enumerate(eqn.invars) if not isinstance(v, jex_core.Literal)]
    operands = [invals[k] for k in at]

    def body(*xs):
        full = list(invals)
        for k, x in zip(at, xs):
            full[k] = x
        return _bind(prim, full, params)

    def jvp(primals, tangents):
        tangents = [jax_compat.zeros_of(jax.typeof(x)) if type(t) is ad.Zero else t
                    for x, t in zip(primals, tangents)]
        n = len(primals)
        closed = jax.make_jaxpr(
            lambda p, t: jax.jvp(lambda *xs: body(*xs), p, t))(list(primals), list(tangents))
        outs, _ = _eval(closed.jaxpr, closed.consts, [*primals, *tangents],
                        [True] * n + [False] * n)
        half = len(outs) // 2
        return outs[:half], outs[half:]

    return composite.bind(LABEL, body, operands, jvp=jvp, name=NAME)
