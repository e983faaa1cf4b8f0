"""herring_jax.allreduce: the sharded parameter-server reduction as a primitive.

Order of this module (as for every collective): public function (validate,
bind) -> abstract eval -> eager impl -> lowering -> jvp / transpose ->
batching -> registration.

The primitive `herring_allreduce` takes any number of arrays and these
parameters:
  op         "sum" or "mean" (the mean divides on the server).
  axes       None: across processes (allreduce). A tuple of mesh axis names:
             across those axes of the enclosing shard_map or pmap (psum/pmean).
  groups     lax's axis_index_groups (a tuple of tuples), or None.
  transpose  axes=None only: the transpose of an allreduce, which under the
             mpi4jax convention is the identity (1/N for a mean), no traffic.
  root       None for a reduction; a rank for a broadcast from it (a sum to
             which every other process contributes zeros, made by the handler
             so that the program is the same on every process); one device
             per process.
  codec      how float32 data crosses between processes: "none", "bf16",
             "fp16" or "int8" (codecs.py); "none" for every other dtype.
  tokens     how many leading operands are start tokens (0 except in
             split.split_reductions): the first is this reduction's own
             start's, the others order it after the other buckets' starts.

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

from herring_jax._src import codecs
from herring_jax._src import jax_compat
from herring_jax._src import layout
from herring_jax._src import lowering
from herring_jax._src import runtime
from herring_jax._src.errors import herring_errors

# What the engine reduces natively; complex numbers travel as pairs of their
# real type, bool is converted to int32 first (as lax.psum does).
SUPPORTED_DTYPES = ("float32", "float64", "bfloat16", "float16", "complex64", "complex128",
                    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
OPS = lowering.OPS


def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; herring_jax supports op='sum' or op='mean'")


def leaf_names(tree: Any) -> list[str]:
    """Each leaf's path in `tree` for error messages ("['params']['w']"; "the
    array" for a tree that is one array)."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return [p or "the array" for p in paths]


def prepare_leaf(name: str, x: Any) -> Any:
    """The leaf as the engine reduces it: an array, bool converted to int32.
    `name` says which leaf it is in errors."""
    raw = getattr(x, "dtype", None)
    dtype = np.dtype(raw) if raw is not None else np.asarray(x).dtype
    # Strings and objects are named here, before jax's conversion fails on them.
    if dtype.kind in "biufc" or dtype.name in SUPPORTED_DTYPES:
        x = jax.numpy.asarray(x)
        dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return x.astype(np.int32)
    if dtype.name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} has dtype {dtype.name}, which herring_jax cannot reduce; supported "
            f"dtypes: bool, {', '.join(SUPPORTED_DTYPES)}. Cast it first, e.g. "
            "x.astype(jnp.float32).")
    return x


def is_floating(x) -> bool:
    return bool(jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))


def leaf_codec(x, codec: str) -> str:
    """The codec a leaf travels with: `codec` for float32, none for the rest
    (which a compressed reduction reduces exactly)."""
    return codec if np.dtype(x.dtype) == np.float32 else "none"


def bind_grouped(leaves, *, ops, codec, axes, groups=None):
    """Binds the leaves as one reduction per (op, codec) they need; results in
    leaf order."""
    kinds = [(o, leaf_codec(v, codec)) for o, v in zip(ops, leaves)]
    outs = [None] * len(leaves)
    for this_op, this_codec in sorted(set(kinds)):
        idx = [i for i, k in enumerate(kinds) if k == (this_op, this_codec)]
        for i, r in zip(idx, bind([leaves[i] for i in idx], op=this_op, axes=axes,
                                  groups=groups, codec=this_codec)):
            outs[i] = r
    return outs


def allreduce(tree: Any, op: str = "sum", *, codec: str = "none") -> Any:
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

    Differentiation follows mpi4jax: the result is one value replicated on every
    process, so the transpose (the gradient) of a sum is the identity on the
    cotangent, with no communication (1/N for a mean over N devices). A
    gradient is therefore never scaled by the number of processes.

    Args:
      tree: a pytree of arrays (float16/32/64, bfloat16, complex64/128,
        (u)int8/16/32/64, bool).
      op: ``"sum"`` or ``"mean"`` (mean divides by the number of contributing
        devices on the server; floating and complex dtypes only).
      codec: how float32 leaves cross between processes: ``"none"`` (exact),
        ``"bf16"``, ``"fp16"`` or ``"int8"`` (lossy, 2x / 2x / 4x fewer bytes;
        see herring_jax/_src/codecs.py). Contributions are decoded and summed
        in float32 in rank order, and the result is encoded once more, so every
        process gets the same bits. Other dtypes are reduced exactly. Every
        process must pass the same codec (a mismatch is a named error).

    Returns:
      A pytree of the same structure with the reduced arrays.

    Raises:
      ValueError: unknown op. TypeError: unsupported dtype, or mean of integers.
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
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    # Before anything that starts the XLA backend (jax.distributed must come
    # first): fail with the helpful message.
    runtime.state()
    names = leaf_names(tree)
    leaves = [prepare_leaf(name, x) for name, x in zip(names, leaves)]
    if op == "mean":
        for name, x in zip(names, leaves):
            if not is_floating(x):
                raise TypeError(
                    f"{name} has integer dtype {np.dtype(x.dtype).name}; op='mean' needs a "
                    "floating dtype (use op='sum' and divide, or cast to float first)")
    outs = bind_grouped(leaves, ops=[op] * len(leaves), codec=codec, axes=None)
    return jax.tree_util.tree_unflatten(treedef, outs)


def bind(leaves, *, op, axes, groups=None, root=None, codec="none"):
    """Binds one reduction; every public function reduces through here."""
    params = dict(op=op, axes=axes, groups=groups, transpose=False, root=root, codec=codec)
    receiver = _receiver.current
    if receiver is None:
        return allreduce_p.bind(*leaves, tokens=0, **params)
    return receiver.bind(leaves, params)


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
# Across processes the result has the operand's type. Across mesh axes it is
# the same on every device of those axes: no longer varying (or unreduced)
# over them, as for lax.psum. Tokens give nothing back.

def _abstract_eval(*avals, op, axes, groups, transpose, root, codec, tokens):
    del op, groups, transpose, root, codec
    avals = avals[tokens:]
    if axes is None:
        return list(avals)
    jax_compat.check_axis_names(axes, "herring_jax.psum")
    return [jax_compat.drop_reduced_axes(a, axes) for a in avals]


def _start_abstract_eval(*avals, op, axes, groups, transpose, root, codec):
    del avals, op, groups, transpose, root, codec
    if axes is not None:
        jax_compat.check_axis_names(axes, "herring_jax.psum")
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


# -- lowering (lowering.py says what each platform gets) ----------------------

def _lower_transposed(ctx, *args, op):
    """The transpose of an allreduce: the identity, or 1/N for a mean."""
    n = layout.contributors(ctx)
    if op == "sum":
        return list(args)
    return mlir.lower_fun(lambda *xs: [x / np.asarray(n, x.dtype) for x in xs],
                          multiple_results=True)(ctx, *args)


def _lowering(ctx, *args, platform, op, axes, groups, transpose, root, codec, tokens):
    own_tokens, args = args[:tokens], args[tokens:]
    avals_in, avals_out = ctx.avals_in[tokens:], ctx.avals_out
    if transpose:
        return _lower_transposed(ctx.replace(avals_in=avals_in), *args, op=op)
    kept = lowering.nonempty(avals_in)
    outs = lowering.zeros_for_empty(avals_out, kept)
    if not kept:
        return outs
    operands = [args[i] for i in kept]
    kept_in = [avals_in[i] for i in kept]
    kept_out = [avals_out[i] for i in kept]
    params = dict(op=op, axes=axes, groups=groups, root=root, codec=codec)
    if platform == "cpu":
        # Tokens order nothing here: XLA:CPU's one call is already asynchronous.
        # A bucket of allreduce_gradients (own tokens) is reduced in place
        # (lowering.join_cpu says why).
        results = lowering.reduce_cpu(ctx, operands, kept_in, kept_out,
                                      in_place=bool(own_tokens), **params)
    elif own_tokens:
        results = lowering.done_cuda(ctx, own_tokens, kept_out, op=op, codec=codec)
    else:
        token = lowering.start_cuda(ctx, operands, kept_in, **params)
        results = lowering.done_cuda(ctx, [token], kept_out, op=op, codec=codec)
    for i, r in zip(kept, results):
        outs[i] = r
    return outs


def _start_lowering(ctx, *args, platform, op, axes, groups, transpose, root, codec):
    del transpose
    kept = lowering.nonempty(ctx.avals_in)
    if platform == "cpu" or not kept:
        return [lowering.token_constant()]
    return [lowering.start_cuda(ctx, [args[i] for i in kept], [ctx.avals_in[i] for i in kept],
                                op=op, axes=axes, groups=groups, root=root, codec=codec)]


# -- differentiation ---------------------------------------------------------
# A sum (or mean) is linear: the JVP reduces the non-zero tangents with the
# same parameters, in one call (a reduction of its own: tokens order only the
# primal one). Transposes:
# - across processes (axes=None), mpi4jax's convention: the result is one
#   replicated value, so the transpose is the identity (1/N for a mean), and
#   the transpose of that is the allreduce again;
# - across mesh axes, lax.psum's: where shard_map tracks varying axes the
#   result was invariant and the transpose only marks the cotangent varying
#   again (pvary; preduced for an unreduced operand), with no communication;
#   without those checks (check_vma=False, pmap) it is the same reduction.
# A start's token has no tangent.

def _jvp(primals, tangents, **params):
    outs = allreduce_p.bind(*primals, **params)
    tangents = tangents[params["tokens"]:]
    nonzero = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
    tangents_out = [jax_compat.zero_tangent(o) for o in outs]
    if nonzero:
        reduced = allreduce_p.bind(*[tangents[i] for i in nonzero], **{**params, "tokens": 0})
        for i, t in zip(nonzero, reduced):
            tangents_out[i] = t
    return outs, tangents_out


def _start_jvp(primals, tangents, **params):
    del tangents
    token = allreduce_start_p.bind(*primals, **params)
    return token, jax_compat.zero_tangent(token)


def _transpose(cts, *args, op, axes, groups, transpose, root, codec, tokens):
    params = dict(op=op, axes=axes, groups=groups, transpose=transpose,
                  root=root, codec=codec, tokens=0)
    args = args[tokens:]
    outs = [ad.Zero(a.aval) if type(ct) is ad.Zero else None for ct, a in zip(cts, args)]
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


# -- batching ----------------------------------------------------------------
# vmap over an axis the reduction does not name: the batch is just more
# elements. vmap(..., axis_name=n) with n among the reduced axes: as lax, the
# batch is reduced in place (an unbatched operand counts axis_size times) and
# the rest of the axes go to the engine; the result is no longer batched. A
# start does the same in-place step, so that it begins the very reduction its
# finishing call binds (XLA merges the two identical local sums).

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
            s = jax.lax.reduce_sum(x, (d,))
            local.append(s / np.asarray(size, x.dtype) if op == "mean" else s)
    return local, tuple(a for a in axes if a != axis_data.name)


def _batch(axis_data, args, dims, *, op, axes, groups, transpose, root, codec, tokens):
    params = dict(op=op, axes=axes, groups=groups, transpose=transpose,
                  root=root, codec=codec, tokens=tokens)
    if axes is None or axis_data.name not in axes:
        return allreduce_p.bind(*args, **params), list(dims[tokens:])
    own_tokens, args, dims = args[:tokens], args[tokens:], dims[tokens:]
    local, rest = _reduce_batch_in_place(axis_data, args, dims, op, axes, groups)
    outs = allreduce_p.bind(*own_tokens, *local, **{**params, "axes": rest}) if rest else local
    return outs, [jax_compat.not_mapped] * len(outs)


def _start_batch(axis_data, args, dims, *, op, axes, groups, transpose, root, codec):
    params = dict(op=op, axes=axes, groups=groups, transpose=transpose, root=root,
                  codec=codec)
    if axes is None or axis_data.name not in axes:
        return allreduce_start_p.bind(*args, **params), jax_compat.not_mapped
    local, rest = _reduce_batch_in_place(axis_data, args, dims, op, axes, groups)
    if not rest:
        return jax.numpy.zeros(lowering.TOKEN.shape, lowering.TOKEN.dtype), jax_compat.not_mapped
    return allreduce_start_p.bind(*local, **{**params, "axes": rest}), jax_compat.not_mapped


# -- registration ------------------------------------------------------------

allreduce_p = jex_core.Primitive("herring_allreduce")
allreduce_p.multiple_results = True
allreduce_p.def_abstract_eval(_abstract_eval)
allreduce_p.def_impl(_impl)
allreduce_start_p = jex_core.Primitive("herring_allreduce_start")
allreduce_start_p.def_abstract_eval(_start_abstract_eval)
allreduce_start_p.def_impl(_start_impl)
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(allreduce_p, functools.partial(_lowering, platform=_platform),
                           platform=_platform, cacheable=False)
    mlir.register_lowering(allreduce_start_p,
                           functools.partial(_start_lowering, platform=_platform),
                           platform=_platform, cacheable=False)
ad.primitive_jvps[allreduce_p] = _jvp
ad.primitive_jvps[allreduce_start_p] = _start_jvp
ad.primitive_transposes[allreduce_p] = _transpose
jax_compat.register_named_batcher(allreduce_p, _batch)
jax_compat.register_named_batcher(allreduce_start_p, _start_batch)
