"""herring_jax.allreduce: the sharded parameter-server reduction as a primitive.

Order of this module (as for every collective): public function (validate,
bind) -> abstract eval -> lowering -> jvp / transpose -> batching ->
registration.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import struct
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from herring_jax._src import jax_compat
from herring_jax._src import runtime
from herring_jax._src.errors import HerringError, herring_errors

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
        args = tuple(leaves[i] for i in reduce_idx)
        if any(isinstance(x, jax.core.Tracer) for x in args):
            # Under a trace, bind directly: a nested jit would be lowered once
            # and shared by every call with the same shapes, merging their
            # call sites (see _next_slot).
            reduced = allreduce_p.bind(*args, op=op, axes=None)
        else:
            # Eager: wait for the result, so that a failed reduction raises
            # HerringError here rather than later from some other array.
            with herring_errors():
                reduced = jax.block_until_ready(_allreduce_jit(args, op=op))
        for i, r in zip(reduce_idx, reduced):
            outs[i] = r
    return jax.tree_util.tree_unflatten(treedef, outs)


@functools.partial(jax.jit, static_argnames=("op",))
def _allreduce_jit(leaves, *, op):
    return tuple(allreduce_p.bind(*leaves, op=op, axes=None))


# -- abstract eval -----------------------------------------------------------
# axes=None: across all processes (allreduce). A tuple of mesh axis names:
# across those axes of the enclosing shard_map (psum/pmean); the result is
# then the same on every device of those axes, as for lax.psum.

def _abstract_eval(*avals, op, axes):
    del op
    if axes is None:
        return list(avals)
    return [jax_compat.drop_varying_axes(a, axes) for a in avals]


# -- lowering ----------------------------------------------------------------

def _key(op: str, avals) -> int:
    """A stable 63-bit description of the call, compared across processes."""
    text = op + ";" + ";".join(f"{np.dtype(a.dtype).name}{tuple(a.shape)}" for a in avals)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] & 0x3FFFFFFFFFFFFFFF


# The handler's "whichever device runs this" for single-device computations.
_ANY_DEVICE = -1
# Groups per call: the wire tag has 6 bits for the group, and the last value
# is the engine's control stream.
_MAX_STREAMS = 63


def _layout(ctx, axes):
    """How this process takes part: its devices, each device's group (stream),
    and each group's processes.

    Returns (local_devices, device_streams, stream_ranks, stream_offsets).
    """
    me = jax.process_index()
    if axes is None:
        devices = jax_compat.computation_devices(ctx)
        if devices is None:
            raise HerringError("herring_jax cannot lower without a concrete device assignment")
        if devices == [None]:
            local = [_ANY_DEVICE]
        else:
            local = [d.id for d in devices if d.process_index == me]
        if not local:
            raise HerringError(f"process {me} has no device in this computation")
        return local, [0] * len(local), list(range(jax.process_count())), [0, jax.process_count()]

    mesh = jax_compat.manual_mesh(ctx)
    if mesh is None:
        raise HerringError(
            f"herring_jax.psum over axes {axes} must be called inside jax.shard_map (or pmap)")
    names = list(mesh.axis_names)
    missing = [a for a in axes if a not in names]
    if missing:
        raise NameError(f"unbound axis name(s) {missing}; the mesh has axes {names}")
    others = [i for i, n in enumerate(names) if n not in axes]
    # Devices that share their coordinates on the other axes reduce together.
    # Groups are numbered in coordinate order: the same on every process.
    groups: dict[tuple, list] = {}
    for idx in np.ndindex(*mesh.devices.shape):
        groups.setdefault(tuple(idx[i] for i in others), []).append(mesh.devices[idx])
    keys = sorted(groups)
    if len(keys) > _MAX_STREAMS:
        raise NotImplementedError(
            f"herring_jax reduces at most {_MAX_STREAMS} groups in one call; this psum over "
            f"{axes} forms {len(keys)}")
    stream_of = {d.id: s for s, k in enumerate(keys) for d in groups[k]}
    local = [d.id for d in mesh.devices.flat if d.process_index == me]
    ranks, offsets = [], [0]
    for k in keys:
        ranks += sorted({d.process_index for d in groups[k]})
        offsets.append(len(ranks))
    return local, [stream_of[d] for d in local], ranks, offsets


def _next_slot(ctx, width: int) -> int:
    """Numbers the call sites of one lowered module: 0, 1, 2, ...

    XLA runs independent custom calls concurrently, in a different order on
    every process, so the engine matches reductions by call site (slot) rather
    than by order. Lowering visits the call sites in program order, which is
    the same on every process. The primitive is registered uncacheable so that
    every call site gets here. One hole remains: jax lowers a nested jitted
    function once per module and calls it from each of its call sites, so its
    reductions share slots (matched by how often each ran; safe when the calls
    depend on each other, ambiguous when XLA may run them concurrently).
    """
    return jax_compat.take_module_counter(ctx, "herring_jax.slot", width)


# Call-site ids unique in this process: the local devices of one execution
# meet on (XLA's run id, site), which no other computation can share.
_SITES = itertools.count(1)


def _lowering(ctx, *args, op, axes):
    state = runtime.state()
    local, streams, ranks, offsets = _layout(ctx, axes)
    slot = _next_slot(ctx, len(args))
    i64 = functools.partial(np.asarray, dtype=np.int64)
    return jax.ffi.ffi_lowering("herring_allreduce", has_side_effect=True)(
        ctx, *args,
        comm=np.int64(state.handle),
        op=np.int64(OPS[op]),
        key=np.int64(_key(op, ctx.avals_in)),
        slot=np.int64(slot),
        site=np.int64(next(_SITES)),
        local_devices=i64(local),
        device_streams=i64(streams),
        stream_ranks=i64(ranks),
        stream_offsets=i64(offsets))


# -- differentiation ---------------------------------------------------------
# A sum (or mean) is linear. Its transpose follows lax.psum: across processes
# (axes=None) and in shard_map without varying-axis checks it is the same
# reduction of the cotangents; where shard_map tracks varying axes, the
# result was invariant and the transpose only marks the cotangent varying
# again (lax's pvary), with no communication.

def _jvp(primals, tangents, *, op, axes):
    outs = allreduce_p.bind(*primals, op=op, axes=axes)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return outs, allreduce_p.bind(*tangents, op=op, axes=axes)


def _transpose(cts, *args, op, axes):
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    if axes is not None and all(jax_compat.is_varying(a.aval, axes) for a in args):
        outs = [jax_compat.pvary(ct, axes) for ct in cts]
        if op == "mean":
            size = jax_compat.axes_size(axes)
            outs = [ct / size for ct in outs]
        return outs
    return allreduce_p.bind(*cts, op=op, axes=axes)


# -- batching ----------------------------------------------------------------
# The reduction is element-wise across processes and devices, so a batch
# dimension (of a vmap over an unnamed axis) is just more elements.

def _batch(args, dims, *, op, axes):
    return allreduce_p.bind(*args, op=op, axes=axes), dims


# -- registration ------------------------------------------------------------

allreduce_p = jex_core.Primitive("herring_allreduce")
allreduce_p.multiple_results = True
allreduce_p.def_abstract_eval(_abstract_eval)
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(allreduce_p, _lowering, platform=_platform, cacheable=False)
ad.primitive_jvps[allreduce_p] = _jvp
ad.primitive_transposes[allreduce_p] = _transpose
batching.primitive_batchers[allreduce_p] = _batch
