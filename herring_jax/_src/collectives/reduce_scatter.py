"""herring_jax.reduce_scatter / allgather / barrier: the process-level
collectives beside allreduce (one device per process in the computation,
outside or inside jax.jit), as mpi4jax and Horovod users know them.

They are herring_allreduce (allreduce.py) with collective "reduce_scatter" or
"all_gather" across processes: the first and the second half of the
parameter-server reduction, each moving (N-1)/N of the buffer per process, and
going through the host stage like allreduce. A barrier is a reduction of one
int32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from herring_jax._src.collectives import allreduce as _allreduce
from herring_jax._src.collectives import codecs
from herring_jax._src.process import runtime
from herring_jax._src.collectives.codecs import BLOCK


def block_size(size: int, nproc: int) -> int:
    """B, the elements of each process's part of a leaf of `size` elements
    (ceil(size / nproc))."""
    return -(-size // nproc)


def reduce_scatter(tree: Any, op: str = "sum", *, codec: str = "none") -> Any:
    """Sums a pytree of process-local arrays across all processes and gives
    each process its part: "the first half" of ``herring_jax.allreduce``.

    The cut: each leaf is flattened (row-major) into its ``size`` elements;
    with N processes and ``B = ceil(size / N)``, the process of rank r gets
    elements ``[r * B, (r + 1) * B)`` of the flattened sum as a 1-D array of
    B elements, zero-padded past ``size`` (so where N does not divide
    ``size`` the last ranks' parts end in zeros, and a part may be all
    zeros). Every process gets the same shape, so every process runs the same
    program. ``jnp.concatenate`` of the parts in rank order, cut to ``size``
    and reshaped, is ``allreduce(tree, op)``, bitwise: the same sums in the
    same order (codecs included).

    Every process must call it with the same tree structure, shapes and
    dtypes, in the same order relative to its other collectives, each with
    one device in the computation (outside jit, or a jit on one device).

    Differentiation follows lax (``psum_scatter``), not allreduce's mpi4jax
    convention: each process's part depends on every process's leaf, so the
    transpose (the gradient) is ``allgather`` of every process's cotangent
    (divided by N for a mean), cut back to the leaf's shape; it communicates,
    and a gradient of the sum of all processes' losses is what comes back.
    (allreduce's transpose is the identity: its result is taken as one
    replicated value.)

    Args:
      tree: a pytree of arrays (float16/32/64, bfloat16, complex64/128,
        (u)int8/16/32/64, bool, which is summed as int32).
      op: ``"sum"`` or ``"mean"`` (divided by N on the server; floating and
        complex dtypes only).
      codec: how float32 leaves cross between processes, as for
        ``herring_jax.allreduce``; a compressed leaf's B must be a multiple
        of 256 (its encoding's block) where N > 1.

    Returns:
      A pytree of the same structure: for each leaf, this process's part, a
      1-D array of B elements of the leaf's dtype (int32 for bool).

    Raises:
      ValueError: unknown op, or a codec with B not a multiple of 256.
      TypeError: unsupported dtype, or a mean of integers.
      HerringError: not initialized, a peer failed or timed out.

    Examples:
      >>> g = herring_jax.reduce_scatter({"w": jnp.ones(10)})    # doctest: +SKIP
      >>> g["w"]   # rank 3 of 4: B = 3, elements 9..11 of the sum, one real  # doctest: +SKIP
      Array([4., 0., 0.], dtype=float32)
    """
    _allreduce.check_op(op, ("sum", "mean"))
    codecs.check_codec(codec)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    runtime.state()  # the helpful message before initialize(), before any JAX call
    n = runtime.process_count()
    names = _allreduce.leaf_names(tree)
    leaves = [_allreduce.prepare_leaf(name, x) for name, x in zip(names, leaves)]
    operands = []
    for name, x in zip(names, leaves):
        if op == "mean" and not _allreduce.is_floating(x):
            raise TypeError(
                f"{name} has integer dtype {np.dtype(x.dtype).name}; op='mean' needs a "
                "floating dtype (use op='sum' and divide, or cast to float first)")
        b = block_size(x.size, n)
        if (n > 1 and b % BLOCK and b > 0
                and _allreduce.leaf_codec(x, codec) != "none"):
            raise ValueError(
                f"herring_jax.reduce_scatter: {name} has {x.size} elements, so each of the {n} "
                f"processes' parts has {b}; codec {codec!r} needs parts of a multiple of "
                f"{BLOCK} elements (its encoding's block). Pad the leaf to a multiple of "
                f"{n * BLOCK} elements, or use codec='none' for it")
        flat = x.reshape(-1)
        if b * n != x.size:
            flat = jnp.pad(flat, (0, b * n - x.size))
        operands.append(flat.reshape(n, b))
    outs = _allreduce.bind_grouped(operands, ops=[op] * len(operands), codec=codec, axes=None,
                                   collective="reduce_scatter")
    return jax.tree_util.tree_unflatten(treedef, outs)


def allgather(x: Any, *, codec: str = "none") -> Any:
    """Gathers every process's array, as mpi4jax's ``allgather``: the result
    has shape ``(N, *x.shape)``, row r from the process of rank r.

    "The second half" of ``herring_jax.allreduce``; exact (every process gets
    bitwise the values sent). Every process must call it with the same shape
    and dtype (a pytree is gathered leaf by leaf), with one device in the
    computation, outside or inside jit. Differentiable: the transpose (lax's
    convention, as for ``reduce_scatter``) sums every process's cotangent of
    the gathered array and gives each process its row, i.e. the gradient of
    the sum of all processes' losses with respect to this process's ``x``.

    Args:
      x: an array, or a pytree of arrays (any dtype psum takes, and bool).
      codec: how float32 leaves cross between processes (``"none"``, exact;
        ``"bf16"``, ``"fp16"``, ``"int8"``, see ``herring_jax.allreduce``):
        every row, its owner's too, is then the codec's rounding of the
        values sent, the same bits on every process. With a lossy codec the
        row's size must be a multiple of 256 elements where N > 1. Other
        dtypes travel exactly.

    Returns:
      The gathered array(s), of shape ``(N, *x.shape)`` and x's dtype.

    Examples:
      >>> herring_jax.allgather(jnp.array([herring_jax.process_index()]))  # doctest: +SKIP
      Array([[0], [1], [2], [3]], dtype=int32)   # with 4 processes
    """
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if not leaves:
        return x
    runtime.state()
    names = _allreduce.leaf_names(x)
    was_bool = [_allreduce.is_bool(v) for v in leaves]
    leaves = [_allreduce.prepare_leaf(name, v, np.uint8) for name, v in zip(names, leaves)]
    codecs.check_codec(codec)
    n = runtime.process_count()
    for name, v in zip(names, leaves):
        if n > 1 and _allreduce.leaf_codec(v, codec) != "none" and v.size % BLOCK:
            raise ValueError(
                f"herring_jax.allgather: {name} has {v.size} elements; codec {codec!r} needs "
                f"rows of a multiple of {BLOCK} elements (its encoding's block). Pad it, or "
                "use codec='none'")
    outs = _allreduce.bind_grouped(leaves, ops=["sum"] * len(leaves), codec=codec, axes=None,
                                   collective="all_gather")
    outs = [o.astype(np.bool_) if b else o for o, b in zip(outs, was_bool)]
    return jax.tree_util.tree_unflatten(treedef, outs)


def barrier() -> None:
    """Returns once every process has called it (mpi4jax's / MPI's barrier).

    A reduction of one int32 through the engine, so it also fails with a
    HerringError (naming the rank) instead of waiting forever when a peer has
    died or never comes (after HERRING_TIMEOUT_S). Called inside ``jax.jit``,
    it is a reduction that XLA places anywhere in the computation: every
    process passes it during the call, nothing more is ordered.

    Examples:
      >>> if herring_jax.process_index() == 0:
      ...     save_checkpoint(state)                         # doctest: +SKIP
      >>> herring_jax.barrier()   # nobody reads it before it is written  # doctest: +SKIP
    """
    runtime.state()
    [out] = _allreduce.bind([jnp.zeros((), jnp.int32)], op="sum", axes=None)
    if not isinstance(out, jax.core.Tracer):
        jax.block_until_ready(out)


def shard_index():
    """This process's rank as an int32 scalar, fit to go into a program.

    Outside a trace it is ``process_index()``. While a trace is being made
    (``jax.jit``, ``jax.eval_shape``, ...) a constant would make each process
    compile a different program, and programs that differ never pair their
    reductions (XLA's run id covers the whole program): the rank then comes
    from a reduce-scatter of ``arange(N)`` instead, whose part r is ``N * r``
    on process r, the same program on every process.
    """
    n = runtime.process_count()
    probe = jnp.zeros((), jnp.int32)
    if n == 1 or not isinstance(probe, jax.core.Tracer):
        return jnp.asarray(runtime.process_index(), jnp.int32)
    [part] = _allreduce.bind([jnp.arange(n, dtype=jnp.int32).reshape(n, 1)], op="sum",
                             axes=None, collective="reduce_scatter")
    return part.reshape(()) // n
