"""herring_jax.allreduce: the sharded parameter-server reduction as a primitive.

Order of this module (as for every collective): public function (validate,
bind) -> abstract eval -> lowering -> jvp / transpose -> batching ->
registration.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from herring_jax._src import jax_compat
from herring_jax._src import runtime
from herring_jax._src.errors import HerringError

SUPPORTED_DTYPES = ("float32", "float64", "bfloat16", "float16", "int32", "int64")
OPS = {"sum": 0, "mean": 1}


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; herring_jax supports op='sum' or op='mean'")


def _check_leaf(index: int, x: Any, op: str) -> None:
    dtype = np.dtype(x.dtype)
    if dtype.name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"leaf {index} has dtype {dtype.name}, which herring_jax cannot reduce; supported "
            f"dtypes: {', '.join(SUPPORTED_DTYPES)}. Cast it first, e.g. x.astype(jnp.float32).")
    if op == "mean" and not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        raise TypeError(
            f"leaf {index} has integer dtype {dtype.name}; op='mean' needs a floating dtype "
            "(use op='sum' and divide, or cast to float first)")


def allreduce(tree: Any, op: str = "sum") -> Any:
    """Reduces a pytree of process-local arrays across all processes.

    Every process must call it with the same tree structure, shapes and dtypes,
    in the same order relative to its other reductions. Works inside and
    outside ``jax.jit``. Inside ``shard_map`` over several local devices the
    devices of a process are summed first and one copy per process crosses the
    network (hierarchical reduction).

    Leaves are summed in rank order by the server that owns each part, so every
    rank gets bitwise the same result, run after run; float16 and bfloat16
    accumulate in float32. NaN and inf propagate as in numpy's sum. Zero-size
    leaves are returned unchanged; an empty tree is returned as is.

    Args:
      tree: a pytree of arrays with dtypes float32, float64, bfloat16, float16,
        int32 or int64.
      op: ``"sum"`` or ``"mean"`` (mean divides by the number of contributing
        devices on the server; floating dtypes only).

    Returns:
      A pytree of the same structure with the reduced arrays.

    Raises:
      ValueError: unknown op. TypeError: unsupported dtype.
      HerringError: not initialized, a peer failed or timed out, or processes
        issued mismatched reductions.

    Examples:
      >>> import jax.numpy as jnp, herring_jax
      >>> herring_jax.initialize()                             # doctest: +SKIP
      >>> herring_jax.allreduce({"w": jnp.ones(3)})            # doctest: +SKIP
      {'w': Array([4., 4., 4.], dtype=float32)}   # with 4 processes
    """
    _check_op(op)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    leaves = [x if hasattr(x, "dtype") else np.asarray(x) for x in leaves]
    for i, x in enumerate(leaves):
        _check_leaf(i, x, op)
    runtime.state()  # fail early, with the helpful message, before tracing
    reduce_idx = [i for i, x in enumerate(leaves) if np.size(x) > 0]
    outs = list(leaves)
    if reduce_idx:
        reduced = _allreduce_jit(tuple(leaves[i] for i in reduce_idx), op=op)
        for i, r in zip(reduce_idx, reduced):
            outs[i] = r
    return jax.tree_util.tree_unflatten(treedef, outs)


@functools.partial(jax.jit, static_argnames=("op",))
def _allreduce_jit(leaves, *, op):
    return tuple(allreduce_p.bind(*leaves, op=op, stream=0, groups=None))


# -- abstract eval -----------------------------------------------------------

def _abstract_eval(*avals, op, stream, groups):
    del op, stream, groups
    return [jax.core.ShapedArray(a.shape, a.dtype) for a in avals]


# -- lowering ----------------------------------------------------------------

def _key(op: str, avals) -> int:
    """A stable 63-bit description of the call, compared across processes."""
    text = op + ";" + ";".join(f"{np.dtype(a.dtype).name}{tuple(a.shape)}" for a in avals)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] & 0x3FFFFFFFFFFFFFFF


# The handler's "whichever device runs this" for single-device computations.
_ANY_DEVICE = -1


def _participants(ctx, groups):
    """(group ranks, local device ids) for this process's part of the call."""
    me = jax.process_index()
    devices = jax_compat.computation_devices(ctx)
    if devices is None:
        raise HerringError("herring_jax cannot lower without a concrete device assignment")
    if devices == [None]:
        return tuple(range(jax.process_count())), [_ANY_DEVICE]
    local = [d.id for d in devices if d.process_index == me]
    if not local:
        raise HerringError(f"process {me} has no device in this computation")
    if groups is None:
        return tuple(range(jax.process_count())), local
    raise NotImplementedError("grouped reductions are lowered by psum")


def _next_slot(ctx, width: int) -> int:
    """Numbers the call sites of one lowered module: 0, 1, 2, ...

    XLA runs independent custom calls concurrently, in a different order on
    every process, so the engine matches reductions by call site (slot) rather
    than by order. Lowering visits the call sites in program order, which is
    the same on every process. The primitive is registered uncacheable so that
    every call site gets here.
    """
    return jax_compat.take_module_counter(ctx, "herring_jax.slot", width)


def _lowering(ctx, *args, op, stream, groups):
    state = runtime.state()
    group, local = _participants(ctx, groups)
    slot = _next_slot(ctx, len(args))
    return jax.ffi.ffi_lowering("herring_allreduce", has_side_effect=True)(
        ctx, *args,
        comm=np.int64(state.handle),
        op=np.int64(OPS[op]),
        key=np.int64(_key(op, ctx.avals_in)),
        slot=np.int64(slot),
        stream=np.int64(stream),
        group=np.asarray(group, dtype=np.int64),
        local_devices=np.asarray(local, dtype=np.int64))


# -- differentiation ---------------------------------------------------------
# A sum (or mean) over processes is linear; its transpose is the same
# reduction of the cotangents, as for lax.psum.

def _jvp(primals, tangents, *, op, stream, groups):
    outs = allreduce_p.bind(*primals, op=op, stream=stream, groups=groups)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    touts = allreduce_p.bind(*tangents, op=op, stream=stream, groups=groups)
    return outs, touts


def _transpose(cts, *args, op, stream, groups):
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    return allreduce_p.bind(*cts, op=op, stream=stream, groups=groups)


# -- batching ----------------------------------------------------------------
# The reduction is element-wise across processes, so a batch dimension is just
# more elements.

def _batch(args, dims, *, op, stream, groups):
    return allreduce_p.bind(*args, op=op, stream=stream, groups=groups), dims


# -- registration ------------------------------------------------------------

allreduce_p = jex_core.Primitive("herring_allreduce")
allreduce_p.multiple_results = True
allreduce_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(allreduce_p, _lowering, platform="cpu", cacheable=False)
ad.primitive_jvps[allreduce_p] = _jvp
ad.primitive_transposes[allreduce_p] = _transpose
batching.primitive_batchers[allreduce_p] = _batch
