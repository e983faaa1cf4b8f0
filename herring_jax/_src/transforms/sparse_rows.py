"""Row-sparse gradients: ``allreduce_gradients(sparse_rows=...)``.

An embedding table's gradient is dense in JAX (a scatter-add into zeros),
yet a step touches only the rows of the tokens it saw: a few percent of a
large vocabulary. Parallax (Kim et al., EuroSys'19) sends such variables as
(row id, row) pairs. Here each process packs the rows it touched, padded to
a bound of K rows per leaf, with their ids and its count of touched rows,
and one herring all-gather hands every process every process's pack. Each
process then sums, locally, every row that some process touched, and writes
the sums into a zero table: every process gets the whole gradient, the
untouched rows exactly zero.

The sum is bitwise the dense reduction's (xla_ffi/engine/reduce_kernels.h,
host_stage.cc): per element ``x_0 + x_1 + ...`` in the engine's order (the
processes of each host by rank, then the hosts in the order of their lowest
rank, where every host holds the same number of processes and reads their
memory; else all processes by rank), starting from the first contribution,
not from zero (``-0.0 + -0.0`` stays ``-0.0``), a process that did not touch
a row contributing ``+0.0`` as its dense gradient holds there; 16-bit types
add in float32 and round once per stage; a mean divides the last stage's
float32 sum by the number of processes, a true division (XLA:CPU would turn
a division by a broadcast scalar into a product with its reciprocal, which
differs in the last bit: the divisor here is an array XLA cannot see through).

Bytes: each process receives (P - 1) packs of K rows (plus K + 1 int32 ids)
per sparse leaf, and sends its own pack to the P - 1 others; the dense
parameter-server reduction moves 2 (P - 1) / P of the table each way. The
gain is about 2 V / (P K) for a table of V rows: it shrinks as processes are
added, unlike Parallax's servers, which own rows by id and send back only
the union (a design this first one does not build).

Under jax.jit the shapes are static, so K is fixed when the step is traced.
A step in which some process touched more than K rows of a leaf reduces that
step's sparse leaves densely instead (the counts travel in the gathered
packs, so every process sees them and takes the same branch of a lax.cond):
the result is the same bits, the bytes those of the dense reduction plus the
gather that was spent.
"""

from __future__ import annotations

import math
import jax
import jax.numpy as jnp
import numpy as np

from herring_jax._src.process import knobs
from herring_jax._src.process import runtime
from herring_jax._src.collectives.allreduce import allreduce
from herring_jax._src.collectives.reduce_scatter import allgather

# Without sparse_max_rows or HERRING_SPARSE_MAX_ROWS: K = 1/16 of a leaf's rows.
DEFAULT_SHARE = 1 / 16
# The update's keyword that carries the step's row ids.
IDS_KEYWORD = "row_ids"


def check_spec(sparse_rows, max_rows, axis_name, compression: str, weighted: bool,
               api: str) -> None:
    """The transformation's sparse_rows / sparse_max_rows arguments, and
    what they cannot be combined with (yet)."""
    if sparse_rows is None:
        if max_rows is not None:
            raise ValueError(f"herring_jax.{api}: sparse_max_rows={max_rows!r} without "
                             "sparse_rows: say which leaves are row-sparse, e.g. "
                             "sparse_rows=lambda path, g: 'embedding' in str(path)")
        return
    if max_rows is not None:
        check_max_rows(max_rows, f"herring_jax.{api}: sparse_max_rows")
    if axis_name is not None:
        raise NotImplementedError(
            f"herring_jax.{api}(sparse_rows=...) reduces across processes (axis_name=None) "
            f"only; got axis_name={axis_name!r}. Reduce over the mesh axis densely (leave "
            "sparse_rows out), or run one process per device")
    if compression != "none":
        raise ValueError(f"herring_jax.{api}: sparse_rows sends its rows exactly and cannot "
                         f"be combined with compression={compression!r}; use one or the other")
    if weighted:
        raise ValueError(f"herring_jax.{api}: sparse_rows cannot be combined with weight= "
                         "(a weighted mean); scale the gradients yourself and use "
                         "average=False, or leave sparse_rows out")


def check_max_rows(value, what: str):
    """A bound: an integer count of rows (>= 1) or a share of a leaf's rows in (0, 1]."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be a number of rows or a share of them, got {value!r}")
    if isinstance(value, (int, np.integer)):
        if value < 1:
            raise ValueError(f"{what} must be at least 1 row, got {value}")
        return int(value)
    if isinstance(value, (float, np.floating)):
        if not 0 < value <= 1:
            raise ValueError(f"{what} as a share of the rows must be in (0, 1], got {value}; "
                             "give an integer for a number of rows")
        return float(value)
    raise TypeError(f"{what} must be a number of rows (int) or a share of them (float), "
                    f"got {value!r}")


def bound(max_rows, rows: int) -> int:
    """K, the rows each process may send of a leaf of `rows` rows per step."""
    if max_rows is None:
        max_rows = knobs.get("HERRING_SPARSE_MAX_ROWS")
    if max_rows is None:
        max_rows = DEFAULT_SHARE
    if isinstance(max_rows, float):
        return max(1, min(rows, math.ceil(max_rows * rows)))
    return max(1, min(rows, max_rows))


def leaf_flags(sparse_rows, tree, api: str) -> list[bool]:
    """Per leaf of `tree` (flatten order): whether it is reduced as sparse rows.
    `sparse_rows` is a predicate (path, leaf) -> bool or a pytree of bools, a
    prefix of the gradients' tree."""
    if callable(sparse_rows):
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        flags = [bool(sparse_rows(path, leaf)) for path, leaf in flat]
    else:
        mask_def = jax.tree_util.tree_structure(sparse_rows)
        try:
            subtrees = mask_def.flatten_up_to(tree)
        except (ValueError, TypeError) as e:
            raise ValueError(f"herring_jax.{api}: sparse_rows must be a predicate "
                             "(path, leaf) -> bool or a pytree of bools with the gradients' "
                             f"structure (or a prefix of it); it does not fit them: {e}") from None
        flags = []
        for m, sub in zip(jax.tree_util.tree_leaves(sparse_rows), subtrees):
            if not isinstance(m, (bool, np.bool_)):
                raise TypeError(f"herring_jax.{api}: the sparse_rows mask holds {m!r}; "
                                "its leaves must be True or False")
            flags += [bool(m)] * len(jax.tree_util.tree_leaves(sub))
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    for name, leaf, f in zip(names, jax.tree_util.tree_leaves(tree), flags):
        if not f:
            continue
        dtype = np.dtype(leaf.dtype)
        if np.ndim(leaf) < 1 or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"herring_jax.{api}: sparse_rows marks the gradient {name} "
                            f"({dtype.name}{list(np.shape(leaf))}), but a row-sparse leaf must "
                            "be a floating array of at least one dimension (rows first), "
                            "such as an embedding table")
    return flags


def step_ids(extra_args: dict, count: int, api: str) -> list:
    """This step's row ids per sparse leaf (None: find the touched rows)."""
    ids = extra_args.get(IDS_KEYWORD)
    if ids is None:
        return [None] * count
    if isinstance(ids, (list, tuple)):
        if len(ids) != count:
            raise ValueError(f"herring_jax.{api}: {IDS_KEYWORD}= holds {len(ids)} arrays for "
                             f"{count} row-sparse leaves; give one array for all of them, or "
                             "one per row-sparse leaf in the gradients' order")
        ids = list(ids)
    else:
        ids = [ids] * count
    for x in ids:
        dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
        if not jnp.issubdtype(dtype, jnp.integer):
            raise TypeError(f"herring_jax.{api}: {IDS_KEYWORD}= must hold integer row ids "
                            f"(the token ids the step looked up), got dtype {dtype.name}")
    return ids


def refuse_ids(extra_args: dict, api: str) -> None:
    if IDS_KEYWORD in extra_args:
        raise TypeError(f"herring_jax.{api}: the update got {IDS_KEYWORD}= but the "
                        "transformation has no row-sparse leaves and would ignore it: build "
                        f"it with herring_jax.{api}(sparse_rows=...), or leave "
                        f"{IDS_KEYWORD}= out")


def summation_order() -> list[list[int]]:
    """The engine's order of a reduction over every process (PlanGroup in
    xla_ffi/engine/host_topology.cc): the ranks of each host, hosts in order,
    where that is hierarchical; else one list per rank (a flat sum by rank,
    which the same two-stage sum reproduces)."""
    n = runtime.process_count()
    topology = runtime.state().topology
    if n > 1 and topology is not None and topology.host_of:
        members: dict[int, list[int]] = {}
        for r in range(n):
            members.setdefault(topology.host_of[r], []).append(r)
        sizes = {len(m) for m in members.values()}
        if (len(sizes) == 1 and sizes.pop() > 1
                and all(topology.memory_shared[h] for h in members)):
            return [members[h] for h in sorted(members)]
    return [[r] for r in range(n)]


def _uint(dtype):
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[np.dtype(dtype).itemsize]


def pack(g, ids, k: int):
    """This process's pack of a leaf, as rows (V, D): (ids (k + 1,) int32,
    the last entry the count of touched rows; rows (k, D)). Touched: the
    given ids in [0, V) (each once), or the rows with any bit set (a row of
    -0.0 is sent: its dense sum differs from that of +0.0)."""
    v = g.shape[0]
    if ids is None:
        bits = jax.lax.bitcast_convert_type(g, _uint(g.dtype))
        mask = jnp.any(bits != 0, axis=1)
    else:
        ids = jnp.asarray(ids).reshape(-1).astype(jnp.int32)
        ids = jnp.where((ids >= 0) & (ids < v), ids, v)  # out of range: dropped
        mask = jnp.zeros((v,), jnp.bool_).at[ids].set(True, mode="drop")
    count = jnp.sum(mask, dtype=jnp.int32)
    (idx,) = jnp.nonzero(mask, size=k, fill_value=v)
    rows = g[jnp.minimum(idx, v - 1)]
    return jnp.concatenate([idx.astype(jnp.int32), count[None]]), rows


def _acc_dtype(dtype):
    return jnp.float32 if np.dtype(dtype).itemsize < 4 else dtype


def sum_rows(ids, rows, order: list[list[int]], mean: bool, v: int):
    """The gathered packs -> the reduced (V, D) table: ids (P, k) (padding
    = v), rows (P, k, D). Every slot's row summed over the processes in the
    engine's order (module docstring), written into zeros."""
    p, k = ids.shape
    dtype, acc_t = rows.dtype, _acc_dtype(rows.dtype)
    slots = ids.reshape(-1)

    def x(r):  # what rank r's dense gradient holds at every slot's row
        where = jnp.full((v + 1,), -1, jnp.int32).at[ids[r]].set(jnp.arange(k, dtype=jnp.int32))
        at = where[slots]
        row = rows[r][jnp.maximum(at, 0)]
        return jnp.where((at >= 0)[:, None], row, jnp.zeros_like(row)).astype(acc_t)

    def in_order(values):
        acc = values[0]
        for y in values[1:]:
            acc = acc + y
        return acc

    def finish(acc):
        if mean:
            # A divisor XLA cannot see as a broadcast scalar: a true division
            # by the process count, as the engine's, not a reciprocal product.
            acc = acc / jax.lax.optimization_barrier(
                jnp.full(acc.shape, sum(len(m) for m in order), acc_t))
        return acc.astype(dtype)

    if len(order) == 1:
        total = finish(in_order([x(r) for r in order[0]]))
    else:
        stage = [in_order([x(r) for r in members]).astype(dtype).astype(acc_t)
                 for members in order]
        total = finish(in_order(stage))
    out = jnp.zeros((v, rows.shape[-1]), dtype)
    return out.at[slots].set(total, mode="drop")


def reduce(leaves: list, ids: list, *, mean: bool, max_rows=None) -> list:
    """Reduces row-sparse `leaves` across processes (see the module
    docstring); `ids[i]` the row ids leaf i's step used, or None."""
    if not leaves:
        return []
    n = runtime.process_count()
    if n == 1:
        return list(leaves)
    shapes = [g.shape for g in leaves]
    tables = [g.reshape(g.shape[0], -1) for g in leaves]
    ks = [bound(max_rows, t.shape[0]) for t in tables]
    packs = [pack(t, i, k) for t, i, k in zip(tables, ids, ks)]
    gathered = allgather(packs)  # [(ids (P, k + 1), rows (P, k, D))]
    counts = jnp.stack([gi[:, -1] for gi, _ in gathered])  # (leaves, P)
    over = jnp.any(counts > jnp.asarray(ks, jnp.int32)[:, None])
    order = summation_order()

    def sparse():
        return [sum_rows(gi[:, :-1], gr, order, mean, t.shape[0])
                for (gi, gr), t in zip(gathered, tables)]

    def dense():
        return list(allreduce(tables, op="mean" if mean else "sum"))

    if isinstance(over, jax.core.Tracer):
        # Every process holds the same counts, so all take the same branch.
        out = jax.lax.cond(over, dense, sparse)
    else:
        out = dense() if bool(over) else sparse()
    return [o.reshape(s) for o, s in zip(out, shapes)]


def packed_bytes(rows: int, row_elements: int, itemsize: int, k: int) -> int:
    """Bytes of one process's pack of a leaf: k rows and k + 1 int32."""
    return k * row_elements * itemsize + 4 * (k + 1)


def model_np(grads: list[np.ndarray], order: list[list[int]], mean: bool) -> np.ndarray:
    """numpy model of the dense reduction of one leaf (grads[rank]) in the
    engine's order: what the sparse result must equal, bitwise."""
    dtype = grads[0].dtype
    acc_t = np.dtype(np.float32) if dtype.itemsize < 4 else dtype

    def in_order(values):
        acc = values[0].astype(acc_t)
        for y in values[1:]:
            acc = acc + y.astype(acc_t)
        return acc

    n = sum(len(m) for m in order)
    if len(order) == 1:
        total = in_order([grads[r] for r in order[0]])
    else:
        total = in_order([in_order([grads[r] for r in m]).astype(dtype) for m in order])
    if mean:
        total = total / acc_t.type(n)
    return total.astype(dtype)

