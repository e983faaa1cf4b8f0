"""herring_jax.allreduce: the sharded parameter-server reduction as a primitive.

Order of this module (as for every collective): public function (validate,
bind) -> abstract eval -> eager impl -> lowering -> jvp / transpose ->
batching (its rules in batching.py) -> registration.

The primitive `herring_allreduce` takes any number of arrays and these
parameters:
  collective what each device gets back: "allreduce" (the reduced buffer),
             "reduce_scatter" (operands of shape (G, *rest), G the devices of
             the group; device i gets the sum of every device's operand[i],
             of shape rest) or "all_gather" (operands of shape rest; every
             device gets (G, *rest), row i from device i), or
             "all_gather_invariant" (the same, its result no longer varying
             over the axes: lax's all_gather(..., to='invarying')). Device i:
             its index in its group (layout.Plan.device_blocks). The two
             halves are each other's transposes (the invariant all-gather's
             is the cotangent's row i, no traffic).
  reduction  "sum", "mean" (the mean divides on the server), "max" or "min"
             (not differentiable; no codec); an all-gather's is "sum". Not
             called `op`: remat policies are called as policy(prim, *avals,
             **params), and JAX's documented `lambda op, *_, **__: ...` would
             get `op` twice.
  axes       None: across processes (allreduce, reduce_scatter, allgather,
             broadcast). A tuple of mesh axis names: across those axes of the
             enclosing shard_map or pmap (psum, pmean, pmax, pmin,
             psum_scatter, all_gather).
  groups     lax's axis_index_groups (a tuple of tuples), or None.
  transpose  axes=None only: the transpose of an allreduce, which under the
             mpi4jax convention is the identity (1/N for a mean), no traffic.
  root       None for a reduction; a rank for a broadcast from it (a sum to
             which every other process contributes zeros, made by the handler
             so that the program is the same on every process); one device
             per process.
  codec      how float32 data crosses between processes: "none", "bf16",
             "fp16" or "int8" (codecs.py); "none" for every other dtype, for
             max and min, and for an all-gather.
  tokens     how many leading operands are start tokens (0 except in
             split.split_reductions): the first is this reduction's own
             start's, the others order it after the other buckets' starts.
  feedback   error feedback (a codec, a sum or mean of float32, not an
             all-gather): after the results, one float32 array per operand
             (its type) with what this device's contribution lost in
             encoding, as the engine encoded it (zeros where it encoded
             nothing: on one host, or another process's slice of its host's
             sum); bind_with_loss binds it. Not differentiable.

`herring_allreduce_start` (bound only by split.split_reductions) takes the
same operands and parameters and returns one token: where XLA:CUDA lowers it,
the reduction begins there and the `herring_allreduce` that takes the token
finishes it; XLA:CPU ignores both and keeps its one asynchronous call.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, mlir

from herring_jax._src.collectives import batching
from herring_jax._src.collectives import codecs
from herring_jax._src.process import jax_compat
from herring_jax._src.process import layout
from herring_jax._src.collectives import lowering
from herring_jax._src.process import runtime
from herring_jax._src.collectives import weighted
from herring_jax._src.process.errors import herring_errors

# What the engine reduces natively; complex numbers travel as pairs of their
# real type, bool is converted to int32 first (as lax.psum does).
SUPPORTED_DTYPES = ("float32", "float64", "bfloat16", "float16", "complex64", "complex128",
                    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
OPS = lowering.OPS


def check_op(op: str, ops=tuple(OPS)) -> None:
    if op not in ops:
        shown = ", ".join(f"op={o!r}" for o in ops)
        raise ValueError(f"unknown op {op!r}; herring_jax supports {shown} here")


def check_extreme(name: str, x, op: str, codec: str) -> None:
    """What a max or min refuses: complex values (which have no order; XLA:CPU
    cannot reduce them either) and a codec (it compresses sums only)."""
    if op not in ("max", "min"):
        return
    if codec != "none":
        raise ValueError(f"op={op!r} takes no codec (got codec={codec!r}): a codec compresses "
                         "sums and means only; pass codec='none'")
    if np.dtype(x.dtype).kind == "c":
        raise TypeError(f"{name} is {np.dtype(x.dtype).name}: complex numbers have no "
                        f"{op}imum (jax.lax.p{op} fails on them too); reduce the real and "
                        "imaginary parts, or jnp.abs(x), instead")


def leaf_names(tree: Any) -> list[str]:
    """Each leaf's path in `tree` for error messages ("['params']['w']"; "the
    array" for a tree that is one array)."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return [p or "the array" for p in paths]


def prepare_leaf(name: str, x: Any, bool_as=np.int32) -> Any:
    """The leaf as the engine reduces it: an array, bool converted to int32
    (`bool_as`: what a max, min or gather takes it as instead).
    `name` says which leaf it is in errors."""
    raw = getattr(x, "dtype", None)
    dtype = np.dtype(raw) if raw is not None else np.asarray(x).dtype
    # Strings and objects are named here, before jax's conversion fails on them.
    if dtype.kind in "biufc" or dtype.name in SUPPORTED_DTYPES:
        x = jax.numpy.asarray(x)
        dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return x.astype(bool_as)
    if dtype.name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} has dtype {dtype.name}, which herring_jax cannot reduce; supported "
            f"dtypes: bool, {', '.join(SUPPORTED_DTYPES)}. Cast it first, e.g. "
            "x.astype(jnp.float32).")
    return x


def is_bool(x) -> bool:
    raw = getattr(x, "dtype", None)
    return (np.dtype(raw) if raw is not None else np.asarray(x).dtype) == np.bool_


def is_floating(x) -> bool:
    return bool(jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))


def non_floating_leaves(tree) -> str:
    """The paths and dtypes of `tree`'s leaves that are not floating point,
    for an error message ("['a'] (int32), ['b'] (bool)", the first three and
    a count of the rest); empty if there are none."""
    bad = [f"{jax.tree_util.keystr(path)} ({np.dtype(x.dtype).name})"
           for path, x in jax.tree_util.tree_flatten_with_path(tree)[0] if not is_floating(x)]
    return ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")


def leaf_codec(x, codec: str) -> str:
    """The codec a leaf travels with: `codec` for float32, none for the rest
    (which a compressed reduction reduces exactly)."""
    return codec if np.dtype(x.dtype) == np.float32 else "none"


def bind_grouped(leaves, *, ops, codec, axes, groups=None, collective="allreduce"):
    """Binds the leaves as one reduction per (op, codec) they need; results in
    leaf order."""
    kinds = [(o, leaf_codec(v, codec)) for o, v in zip(ops, leaves)]
    outs = [None] * len(leaves)
    for this_op, this_codec in sorted(set(kinds)):
        idx = [i for i, k in enumerate(kinds) if k == (this_op, this_codec)]
        for i, r in zip(idx, bind([leaves[i] for i in idx], op=this_op, axes=axes,
                                  groups=groups, codec=this_codec, collective=collective)):
            outs[i] = r
    return outs


def allreduce(tree: Any, op: str = "sum", *, codec: str = "none", weight=None) -> Any:
    """Reduces a pytree of process-local arrays across all processes.

    Every process must call it with the same tree structure, shapes and dtypes,
    in the same order relative to its other reductions. Works inside and
    outside ``jax.jit``, and under ``jax.grad``, ``jvp``, ``vjp``, ``vmap`` and
    ``linear_transpose`` either way. The reduction is hierarchical: the local
    devices of a process are summed first, then the processes of a host
    through memory, and only each host's share crosses the network.

    Leaves are summed in a fixed order (devices of a process, processes of a
    host by rank, hosts in the order of their lowest rank), so every rank gets
    bitwise the same result, run after run; float16 and bfloat16 accumulate in
    float32. NaN and inf propagate as in numpy's sum. bool leaves
    are summed as int32 (as lax.psum does); zero-size leaves are returned
    unchanged; an empty tree is returned as is.

    ``op="max"`` / ``"min"`` (mpi4jax's ``MPI.MAX`` / ``MPI.MIN``; e.g. a
    global maximum of a loss scale, or early stopping) keep bool leaves bool
    (a logical or / and), propagate NaN (NaN wins, as in ``jnp.maximum``),
    refuse complex leaves and a codec, and are not differentiable (as
    ``jax.lax.pmax``: ``jax.grad`` raises NotImplementedError).

    Differentiation follows mpi4jax: the result is one value replicated on every
    process, so the transpose (the gradient) of a sum is the identity on the
    cotangent, with no communication (1/N for a mean over N devices). A
    gradient is therefore never scaled by the number of processes.

    Args:
      tree: a pytree of arrays (float16/32/64, bfloat16, complex64/128,
        (u)int8/16/32/64, bool).
      op: ``"sum"``, ``"mean"`` (mean divides by the number of contributing
        devices on the server; floating and complex dtypes only), ``"max"``
        or ``"min"``.
      codec: how float32 leaves cross between processes: ``"none"`` (exact),
        ``"bf16"``, ``"fp16"`` or ``"int8"`` (lossy, 2x / 2x / 4x fewer bytes;
        see herring_jax/_src/collectives/codecs.py). Contributions are decoded and summed
        in float32 in rank order, and the result is encoded once more, so every
        process gets the same bits. Other dtypes are reduced exactly. Every
        process must pass the same codec (a mismatch is a named error).
      weight: with ``op="mean"`` only: this process's weight, a real scalar
        (e.g. the examples or tokens it used; a traced value under jit is
        fine). The result is ``sum_i(w_i x_i) / sum_i(w_i)``, bitwise the
        same on every process: ``w_i x_i`` is rounded once to the leaf's
        dtype on each process, both sums are herring's, then one scalar
        division 1 / W and the sum times it (herring_jax/_src/collectives/weighted.py
        has the exact rounding). A weight of
        0 contributes zeros whatever the data; a total weight of 0 gives
        zeros; a negative or non-finite weight anywhere gives NaN in every
        leaf (and raises ValueError on every process outside ``jax.jit``).
        The weight crosses exactly, whatever the codec.

    Returns:
      A pytree of the same structure with the reduced arrays.

    Raises:
      ValueError: unknown op, a codec with max/min, a weight with an op other
        than mean or a weight that is not a scalar. TypeError: unsupported
        dtype, mean of integers, or max/min of complex numbers.
      HerringError: not initialized, a peer failed or timed out, or processes
        issued mismatched reductions.

    Examples:
      >>> import jax.numpy as jnp, herring_jax
      >>> herring_jax.initialize()                             # doctest: +SKIP
      >>> herring_jax.allreduce({"w": jnp.ones(3)})            # doctest: +SKIP
      {'w': Array([4., 4., 4.], dtype=float32)}   # with 4 processes
    """
    check_op(op)
    codecs.check_codec(codec)
    if weight is not None:
        weighted.check_op(op, "herring_jax.allreduce")
        weight = weighted.check_weight(weight, "herring_jax.allreduce")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    # Before anything that starts the XLA backend (jax.distributed must come
    # first): fail with the helpful message.
    runtime.state()
    names = leaf_names(tree)
    extreme = op in ("max", "min")
    # A max or min of bool is a logical or / and: reduced as uint8, kept bool.
    was_bool = [is_bool(x) for x in leaves]
    leaves = [prepare_leaf(name, x, np.uint8 if extreme else np.int32)
              for name, x in zip(names, leaves)]
    for name, x in zip(names, leaves):
        check_extreme(name, x, op, codec)
    if op == "mean":
        for name, x in zip(names, leaves):
            if not is_floating(x):
                raise TypeError(
                    f"{name} has integer dtype {np.dtype(x.dtype).name}; op='mean' needs a "
                    "floating dtype (use op='sum' and divide, or cast to float first)")
    if weight is not None:
        return jax.tree_util.tree_unflatten(treedef, weighted.mean(
            leaves, weight, codec, "herring_jax.allreduce",
            lambda xs, c: bind_grouped(xs, ops=["sum"] * len(xs), codec=c, axes=None)))
    outs = bind_grouped(leaves, ops=[op] * len(leaves), codec=codec, axes=None)
    if extreme:
        outs = [o.astype(np.bool_) if b else o for o, b in zip(outs, was_bool)]
    return jax.tree_util.tree_unflatten(treedef, outs)


def bind(leaves, *, op, axes, groups=None, root=None, codec="none", collective="allreduce",
         feedback=False):
    """Binds one reduction; every public function reduces through here."""
    params = dict(reduction=op, axes=axes, groups=groups, transpose=False, root=root, codec=codec,
                  collective=collective, feedback=feedback)
    receiver = _receiver.current
    if receiver is None:
        return allreduce_p.bind(*leaves, tokens=0, **params)
    return receiver.bind(leaves, params)


def bind_with_loss(leaves, *, op, axes, codec, collective="allreduce"):
    """Error feedback's reduction of float32 `leaves` (a lossy `codec`): their
    reductions and, per leaf, what this device's contribution lost on the wire
    (the leaf's shape; zeros where nothing of it was encoded). `axes`: as for
    bind, None for the processes; one-sized axes reduce nothing (as psum's)."""
    if axes is not None and collective == "allreduce":
        axes = jax_compat.skip_one_sized_axes(tuple(axes))
        if not axes:
            return list(leaves), [jax.numpy.zeros_like(x) for x in leaves]
    outs = bind(leaves, op=op, axes=axes, codec=codec, collective=collective, feedback=True)
    return outs[:len(leaves)], outs[len(leaves):]


# While split.py's split_reductions traces, a receiver of its own takes every
# reduction bound here instead (it binds the start, then the rest).

class _Receiver(threading.local):
    current = None


_receiver = _Receiver()


@contextlib.contextmanager
def binds_received_by(receiver):
    """Within: bind(leaves, ...) returns receiver.bind(leaves, params)."""
    previous, _receiver.current = _receiver.current, receiver
    try:
        yield
    finally:
        _receiver.current = previous


# -- abstract eval -----------------------------------------------------------
# An all-reduce across processes gives the operand's type. Across mesh axes
# the result is the same on every device of those axes: no longer varying (or
# unreduced) over them, as for lax.psum. A reduce-scatter takes (G, *rest) and
# gives rest, an all-gather the reverse (G: the devices of a group); both keep
# the operand's varying axes, as lax's psum_scatter and all_gather do (the
# operand must vary over the axes: the drop-ins pvary it first, as lax).
# Tokens give nothing back.

API_NAMES = {"allreduce": "herring_jax.psum", "reduce_scatter": "herring_jax.psum_scatter",
             "all_gather": "herring_jax.all_gather",
             "all_gather_invariant": "herring_jax.all_gather"}
GATHERS = ("all_gather", "all_gather_invariant")


def group_count(axes, groups) -> int:
    """G, the devices in each group: the processes, across processes (one
    device each)."""
    if axes is None:
        return runtime.process_count()
    return layout.group_size(axes, groups)


def _reshaped(aval, shape, spec):
    return aval.update(shape=tuple(shape),
                       sharding=aval.sharding.update(spec=jax.sharding.PartitionSpec(*spec)))


def _abstract_eval(*avals, reduction, axes, groups, transpose, root, codec, tokens, collective,
                   feedback):
    del reduction, transpose, root, codec
    avals = avals[tokens:]
    outs = _reduced_avals(avals, axes, groups, collective)
    # The losses are each device's own: its operands' types.
    return outs + list(avals) if feedback else outs


def _reduced_avals(avals, axes, groups, collective):
    api = API_NAMES[collective]
    if axes is not None:
        jax_compat.check_axis_names(axes, api)
    if collective == "allreduce":
        return list(avals) if axes is None else [jax_compat.drop_reduced_axes(a, axes)
                                                 for a in avals]
    if axes is not None:
        for a in avals:
            jax_compat.check_varying(a, axes, api)
    size = group_count(axes, groups)
    if collective in GATHERS:
        outs = [_reshaped(a, (size, *a.shape), (None, *a.sharding.spec)) for a in avals]
        if collective == "all_gather_invariant":
            outs = [jax_compat.drop_reduced_axes(o, axes) for o in outs]
        return outs
    for a in avals:
        if not a.shape or a.shape[0] != size:
            raise ValueError(f"{api}: a reduce-scatter over groups of {size} devices takes "
                             f"operands of shape ({size}, ...), got {a.str_short()}; "
                             "this is a herring_jax bug: please report it")
    return [_reshaped(a, a.shape[1:], tuple(a.sharding.spec)[1:]) for a in avals]


def _start_abstract_eval(*avals, reduction, axes, groups, transpose, root, codec, collective,
                         feedback):
    del avals, reduction, groups, transpose, root, codec, feedback
    if axes is not None:
        jax_compat.check_axis_names(axes, API_NAMES[collective])
    return lowering.TOKEN


# -- eager impl ---------------------------------------------------------------
# Outside jit the primitive runs as its own small jitted computation (one per
# parameter set, cached), and waits: a failed reduction raises HerringError
# here rather than later from some other array. A start is only ever bound
# inside a jitted step, next to the reduction that finishes it.

@functools.lru_cache(maxsize=None)
def _eager(**params):
    return jax.jit(lambda *xs: allreduce_p.bind(*xs, **params))


def _impl(*args, **params):
    with herring_errors():
        return jax.block_until_ready(_eager(**params)(*args))


def _start_impl(*args, **params):
    raise NotImplementedError(
        "herring_allreduce_start runs only inside jax.jit, bound by allreduce_gradients; "
        "evaluate the jaxpr that holds it with jax.jit instead of eagerly")


# -- lowering: lowering.lower and lowering.lower_start (registered below) -----


# -- differentiation ---------------------------------------------------------
# A sum (or mean) is linear: the JVP reduces the non-zero tangents with the
# same parameters, in one call (a reduction of its own: tokens order only the
# primal one). A max or min is not differentiated, as lax's pmax and pmin.
# Transposes of an all-reduce:
# - across processes (axes=None), mpi4jax's convention: the result is one
#   replicated value, so the transpose is the identity (1/N for a mean), and
#   the transpose of that is the allreduce again;
# - across mesh axes, lax.psum's: where shard_map tracks varying axes the
#   result was invariant and the transpose only marks the cotangent varying
#   again (pvary; preduced for an unreduced operand), with no communication;
#   without those checks (check_vma=False, pmap) it is the same reduction.
# A reduce-scatter and an all-gather transpose to each other over the same
# devices and groups, as lax's psum_scatter and all_gather, across processes
# too (1/G for a mean); the all-gather of a cotangent is exact (no codec). An
# invariant all-gather's cotangent is the same on every device, so each takes
# its own row of it (lax's all_gather_invariant transposes alike).
# A start's token has no tangent.

def _jvp(primals, tangents, **params):
    op = params["reduction"]
    if op in ("max", "min"):
        raise NotImplementedError(
            f"herring_jax's p{op} (and allreduce(op={op!r})) is not differentiable, as "
            f"jax.lax.p{op} is not (\"Differentiation rule for 'p{op}' not implemented\"): "
            "apply it to jax.lax.stop_gradient(x) where its gradient is not needed")
    outs = allreduce_p.bind(*primals, **params)
    tangents = tangents[params["tokens"]:]
    nonzero = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
    # What encoding lost is not differentiated (as a rounding is not): zero.
    tangents_out = [jax_compat.zero_tangent(o) for o in outs]
    if nonzero:
        reduced = allreduce_p.bind(*[tangents[i] for i in nonzero],
                                   **{**params, "tokens": 0, "feedback": False})
        for i, t in zip(nonzero, reduced):
            tangents_out[i] = t
    return outs, tangents_out


def _start_jvp(primals, tangents, **params):
    del tangents
    token = allreduce_start_p.bind(*primals, **params)
    return token, jax_compat.zero_tangent(token)


def _transpose(cts, *args, reduction, axes, groups, transpose, root, codec, tokens, collective,
               feedback):
    if feedback:
        raise NotImplementedError("herring_jax: a reduction with error feedback is not linear "
                                  "(its losses are not) and cannot be transposed; this is a "
                                  "herring_jax bug: please report it")
    op = reduction
    params = dict(reduction=op, axes=axes, groups=groups, transpose=transpose,
                  root=root, codec=codec, tokens=0, collective=collective, feedback=False)
    args = args[tokens:]
    outs = [ad.Zero(a.aval) if type(ct) is ad.Zero else None for ct, a in zip(cts, args)]
    if collective != "allreduce":
        return [None] * tokens + _transpose_half(cts, outs, op, axes, groups, collective)
    if axes is None:
        todo = [i for i, o in enumerate(outs) if o is None]
        params["transpose"] = not transpose
    else:
        todo = []
        for i, (ct, a) in enumerate(zip(cts, args)):
            if outs[i] is not None:
                continue
            if jax_compat.is_unreduced(a.aval, axes):
                outs[i] = jax_compat.preduced(ct, axes)
            elif jax_compat.is_varying(a.aval, axes):
                ct = jax_compat.pvary(ct, axes)
                outs[i] = ct / layout.group_size(axes, groups) if op == "mean" else ct
            else:
                todo.append(i)
    if todo:
        for i, r in zip(todo, allreduce_p.bind(*[cts[i] for i in todo], **params)):
            outs[i] = r
    return [None] * tokens + outs


def _transpose_half(cts, outs, op, axes, groups, collective):
    """A reduce-scatter's transpose is the all-gather of its cotangents, and
    the reverse; `outs` holds the symbolic zeros already."""
    todo = [i for i, o in enumerate(outs) if o is None]
    if not todo:
        return outs
    if collective == "all_gather_invariant":
        index = jax.lax.axis_index(tuple(axes))
        for i in todo:
            outs[i] = jax.lax.dynamic_index_in_dim(cts[i], index, 0, keepdims=False)
        return outs
    other = "all_gather" if collective == "reduce_scatter" else "reduce_scatter"
    cts = [cts[i] for i in todo]
    if axes is not None:
        cts = [jax_compat.vary_over(ct, axes) for ct in cts]
    results = allreduce_p.bind(*cts, reduction="sum", axes=axes, groups=groups, transpose=False,
                               root=None, codec="none", tokens=0, collective=other,
                               feedback=False)
    if op == "mean":
        n = group_count(axes, groups)
        results = [r / np.asarray(n, r.dtype) for r in results]
    for i, r in zip(todo, results):
        outs[i] = r
    return outs


# -- batching (batching.py has the rules) -------------------------------------
# A start is batched as the reduction it begins, so that it begins the very
# reduction its finishing call binds (XLA merges the two identical local sums).

def _batch(axis_data, args, dims, **params):
    tokens = params["tokens"]
    operands, how, out_dims = batching.batched(axis_data, args[tokens:], dims[tokens:],
                                               params, API_NAMES[params["collective"]])
    if params["feedback"]:
        out_dims = list(out_dims) + _loss_dims(axis_data, operands, dims[tokens:], params)
    if operands is None:
        return how, out_dims
    return allreduce_p.bind(*args[:tokens], *operands, **how), out_dims


def _loss_dims(axis_data, operands, dims, params):
    """The batch dimensions of error feedback's losses: their operands'
    as bound (a reduce-scatter's batched first moves behind G)."""
    axes = params["axes"]
    if operands is None or (axes is not None and axis_data.name in axes):
        raise NotImplementedError("herring_jax: error feedback over an axis bound by jax.vmap "
                                  "is not supported; reduce over mesh axes or processes")
    if params["collective"] != "reduce_scatter":
        return list(dims)
    return [d if d is jax_compat.not_mapped or d != 0 else 1 for d in dims]


def _start_batch(axis_data, args, dims, **params):
    operands, how, _ = batching.batched(axis_data, args, dims, {**params, "tokens": 0},
                                        API_NAMES[params["collective"]])
    if operands is None:
        return jax.numpy.zeros(lowering.TOKEN.shape, lowering.TOKEN.dtype), jax_compat.not_mapped
    how = {k: v for k, v in how.items() if k != "tokens"}
    return allreduce_start_p.bind(*operands, **how), jax_compat.not_mapped


# -- registration ------------------------------------------------------------

allreduce_p = jex_core.Primitive("herring_allreduce")
allreduce_p.multiple_results = True
allreduce_p.def_abstract_eval(_abstract_eval)
allreduce_p.def_impl(_impl)
allreduce_start_p = jex_core.Primitive("herring_allreduce_start")
allreduce_start_p.def_abstract_eval(_start_abstract_eval)
allreduce_start_p.def_impl(_start_impl)
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(allreduce_p, functools.partial(lowering.lower, platform=_platform),
                           platform=_platform, cacheable=False)
    mlir.register_lowering(allreduce_start_p,
                           functools.partial(lowering.lower_start, platform=_platform),
                           platform=_platform, cacheable=False)
ad.primitive_jvps[allreduce_p] = _jvp
ad.primitive_jvps[allreduce_start_p] = _start_jvp
ad.primitive_transposes[allreduce_p] = _transpose
jax_compat.register_named_batcher(allreduce_p, _batch)
jax_compat.register_named_batcher(allreduce_start_p, _start_batch)
