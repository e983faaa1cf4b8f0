"""allreduce_gradients: the optax gradient transformation that averages (or
sums) gradients across processes or a mesh axis through herring_jax."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from herring_jax._src.collectives import allreduce as _allreduce
from herring_jax._src.collectives import codecs
from herring_jax._src.transforms import fusion
from herring_jax._src.process import jax_compat
from herring_jax._src.process import runtime
from herring_jax._src.transforms import sparse_rows as sparse_lib
from herring_jax._src.collectives import weighted
from herring_jax._src.collectives.allreduce import allreduce
from herring_jax._src.collectives.split import split_reductions
from herring_jax._src.collectives.psum import check_gradients, pmean, psum

# The first buffer of each dtype holds at most this much, and no more than the
# others (first_bucket_bytes=None), so that the first reduction starts early.
DEFAULT_FIRST_BUCKET_BYTES = 2**20
# With fusion_bytes=None, buffers of about a sixteenth of the gradients of a
# dtype, kept between 256 KiB and 25 MiB (PyTorch DDP's bucket size): a small
# model gets enough buffers for its reductions to overlap the backward pass
# (2 simulated hosts, 8 MiB MLP: hidden fraction 0.53 with 1 MiB buffers, 0.32
# with 2 MiB, below 0 with one 25 MiB buffer; train_lm's 1.8 MiB, pinned: step
# 88.0 ms with 256 KiB buffers against 96.7 with its two of about 1 MiB), a
# large one no more calls than needed.
AUTO_BUCKETS = 16
MIN_FUSION_BYTES = 2**18
MAX_FUSION_BYTES = 25 * 2**20
# In a job with server-only processes (herring-jax launch --servers), buffers
# of about a quarter of the gradients, never below the smallest buffer the
# servers take (HERRING_SERVER_MIN_BYTES) and at most 64 MiB: a served
# reduction gains more the larger its buffer (4 simulated hosts, 4 servers:
# 25 MiB 1.57x, 100 MiB 1.75x), and several concurrent ones less than one call
# of the same bytes. train-bench --simulated-accelerator, 161 MiB of
# gradients: step 2680 ms with 40 MiB buffers, 2877 with 64, 2956 with 25,
# against 3546 ms without servers (its default buffers); 44.7 MiB: 1138 ms
# with 12 MiB, 1258 with 23, against 1208 (BENCHMARKS.md, "train-bench
# --simulated-accelerator with servers"). The default buffers of a sixteenth
# were below the servers' smallest buffer for any model under 64 MiB of
# gradients, so that the servers carried nothing. Gradients of a dtype below
# that smallest buffer keep the default: no buffer of theirs could pay.
AUTO_SERVED_BUCKETS = 4
MAX_SERVED_FUSION_BYTES = 64 * 2**20


def check_bucket_sizes(fusion_bytes, first_bucket_bytes) -> None:
    """The transformations' bucket-size arguments: None (the default) or positive."""
    if ((fusion_bytes is not None and fusion_bytes <= 0)
            or (first_bucket_bytes is not None and first_bucket_bytes <= 0)):
        raise ValueError("fusion_bytes and first_bucket_bytes must be positive, got "
                         f"{fusion_bytes} and {first_bucket_bytes}")


def plan_buckets(leaves, fusion_bytes: int | None, first_bucket_bytes: int | None,
                 ready, servers_pay: bool = False) -> list:
    """The fusion buckets of gradient `leaves` (fusion.plan) for the fusion_bytes
    and first_bucket_bytes options (None: the defaults above); `ready` is
    jax_compat.production_order's. servers_pay: the default follows the job's
    servers (AUTO_SERVED_BUCKETS). Only where the result is the same bits
    whatever the buckets: allreduce_gradients uncompressed. Not
    sharded_optimizer (a global norm sums over its buckets' chunks), not a
    codec (it encodes each buffer's chunks), not fully_sharded (a bucket's
    parameters are gathered whole): there the servers must not change the
    training."""
    servers, server_min_bytes = runtime.job_servers() if servers_pay else (0, 0)
    size = (auto_fusion_bytes(leaves, servers, server_min_bytes) if fusion_bytes is None
            else fusion_bytes)
    first = (min(DEFAULT_FIRST_BUCKET_BYTES, size) if first_bucket_bytes is None
             else first_bucket_bytes)
    return fusion.plan(leaves, size, first, ready=ready)


def auto_fusion_bytes(leaves, servers: int = 0, server_min_bytes: int = 0) -> int:
    """fusion_bytes for fusion_bytes=None: see AUTO_BUCKETS, and
    AUTO_SERVED_BUCKETS in a job of `servers` server-only processes."""
    per_dtype: dict = {}
    for x in leaves:
        nbytes = int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
        per_dtype[np.dtype(x.dtype)] = per_dtype.get(np.dtype(x.dtype), 0) + nbytes
    largest = max(per_dtype.values(), default=0)
    if servers > 0 and largest >= server_min_bytes:
        return int(min(MAX_SERVED_FUSION_BYTES,
                       max(MIN_FUSION_BYTES, server_min_bytes, largest // AUTO_SERVED_BUCKETS)))
    return int(min(MAX_FUSION_BYTES, max(MIN_FUSION_BYTES, largest // AUTO_BUCKETS)))


class AllReduceGradientsState(NamedTuple):
    """allreduce_gradients keeps no state."""


class CompressedGradientsState(NamedTuple):
    """allreduce_gradients(compression=...) with error feedback: what the
    part of the reduction this process encoded lost at the last step (one
    array per float32 gradient leaf, () for the others), added to its next
    gradients."""

    residual: Any


def is_f32(x) -> bool:
    """Whether a leaf carries an error-feedback residual (float32 leaves only)."""
    return np.dtype(x.dtype) == np.float32


def zero_residual(params):
    """Error feedback's first residual: zeros for float32 leaves, a scalar
    placeholder for the others."""
    return jax.tree_util.tree_map(
        lambda p: jnp.zeros(p.shape if is_f32(p) else (), jnp.float32), params)


def before_reduction(leaves: list, weight, residual) -> list:
    """A step's gradient leaves as they enter the reduction: scaled by this
    process's weight (if any), then with last step's residual added to the
    float32 ones (if error feedback is on, `residual` being its leaves)."""
    if weight is not None:
        leaves = [weighted.scaled(g, weight) for g in leaves]
    if residual is not None:
        leaves = [g + e if is_f32(g) else g for g, e in zip(leaves, residual)]
    return leaves


def allreduce_gradients(axis_name=None, *, average: bool = True,
                        fusion_bytes: int | None = None,
                        first_bucket_bytes: int | None = None,
                        compression: str = "none", error_feedback: bool = True,
                        weight: bool | str = False, sparse_rows=None,
                        sparse_max_rows: int | float | None = None
                        ) -> optax.GradientTransformationExtraArgs:
    """Reduces gradients across data-parallel workers with Herring.

    Put it first in an ``optax.chain``. Gradients are packed into fusion
    buffers per dtype in the order the backward pass produces them (read from
    the traced program inside jit), one reduction per buffer, then unpacked.
    Inside the jitted training step each buffer's reduction starts as soon as
    its gradients exist and runs while the rest of the backward pass is
    computed; the optimizer waits only where it reads the result (XLA:CPU: one
    asynchronous custom call per buffer; XLA:CUDA: a start per buffer, and
    every buffer's done after the last start).

    Args:
      axis_name: None reduces process-local gradients across processes (one
        process per accelerator, Horovod style). A mesh axis name (or tuple)
        reduces over that axis inside ``jax.shard_map`` / ``pmap``. Inside
        shard_map, use ``check_vma=False`` (pmap semantics) so that gradients
        of replicated parameters stay per-device: with varying-axis checks on,
        jax already sums them over the mesh in the backward pass, and the
        update raises ValueError while tracing rather than reduce them again.
      average: mean (True) or sum (False) of the gradients.
      fusion_bytes: the most bytes in one fusion buffer. None (default): about a
        sixteenth of the gradients of each dtype, between 256 KiB and 25 MiB, so
        that small models get enough buffers to overlap; uncompressed, in a
        job with server-only processes (``herring-jax launch --servers K``),
        about a quarter, at least ``HERRING_SERVER_MIN_BYTES`` and at most 64
        MiB, so that the servers take them (the same sums, bitwise).
      first_bucket_bytes: the most bytes in the first buffer of each dtype,
        so that the first reduction starts early. None (default): 1 MiB, or
        the fusion buffer size where that is smaller.
      compression: the wire codec of float32 gradients: ``"none"`` (exact),
        ``"bf16"``, ``"fp16"`` or ``"int8"`` (see ``herring_jax.allreduce``).
      error_feedback: with a lossy codec, keep in the optimizer state what
        encoding lost and add it to the next step's gradients (EF-SGD), so
        that the error does not accumulate. The engine reports what it
        encoded: the residual is exactly what the contributions lost on the
        wire, kept once. Where a process's buffer crosses the wire (one
        process per host, or the host stage off) it keeps its own loss; where
        the host stage sums a host's processes first, each keeps the loss of
        the slice of the host's sum it encodes; on one host nothing is
        encoded and the residual stays zero (the reduction is exact).
      weight: True: a weighted mean, each worker's gradients counted in
        proportion to a scalar it passes at every step, e.g. the examples or
        tokens it used: ``tx.update(grads, state, params, weight=w)`` (optax's
        extra arguments, which ``optax.chain`` hands on; a traced scalar in
        the jitted step). The result is ``sum_i(w_i g_i) / sum_i(w_i)``,
        with the arithmetic and the rules of
        ``herring_jax.allreduce(..., op="mean", weight=w)`` (a total weight
        of 0 gives zero gradients; a negative or non-finite weight NaN
        everywhere); the weight rides in the first float32 buffer (a buffer
        of its own, sent exactly, with a codec). A string names the
        keyword instead of ``weight``. With error feedback the residual is
        kept in the weighted terms (added to the next ``w * g``). Needs
        ``average=True``.
      sparse_rows: which gradients are row-sparse (embedding tables, of which
        a step touches few rows): a predicate ``f(path, leaf) -> bool`` on the
        gradients' key paths and leaves, or a pytree of bools with their
        structure (or a prefix of it). Each process sends only the rows it
        touched, through one all-gather, and sums every touched row locally:
        the result is bitwise the dense reduction's, zeros in the rows no
        process touched. The rows touched are the update's ``row_ids=``
        (``tx.update(grads, state, params, row_ids=tokens)``: one integer
        array for every sparse leaf, or a list of one per sparse leaf; the
        gradient must be zero outside them), or without it the rows with
        any bit set. Across processes only (``axis_name=None``), without
        ``compression`` or ``weight``. See the sparse rows guide.
      sparse_max_rows: K, the most rows a process sends per sparse leaf and
        step (the shapes are static under jit): an int, or a float in (0, 1]
        for a share of the leaf's rows. None: ``HERRING_SPARSE_MAX_ROWS``,
        else 1/16 of the rows. A step in which any process touched more rows
        reduces its sparse leaves densely (the same bits; every process
        takes the same branch).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Examples:
      >>> tx = optax.chain(herring_jax.allreduce_gradients(), optax.adamw(1e-3))
      >>> opt_state = tx.init(params)                                 # doctest: +SKIP
      >>> updates, opt_state = tx.update(grads, opt_state, params)    # doctest: +SKIP
      >>> tx = optax.chain(herring_jax.allreduce_gradients(weight=True), optax.adamw(1e-3))
      >>> updates, opt_state = tx.update(grads, opt_state, params,
      ...                                weight=examples_used)        # doctest: +SKIP
      >>> tx = herring_jax.allreduce_gradients(
      ...     sparse_rows=lambda path, g: "embedding" in jax.tree_util.keystr(path))
      >>> updates, opt_state = tx.update(grads, opt_state, params,
      ...                                row_ids=tokens)              # doctest: +SKIP
    """
    check_bucket_sizes(fusion_bytes, first_bucket_bytes)
    codecs.check_codec(compression)
    feedback = error_feedback and compression != "none"
    weight_key = weight_keyword(weight, average, "allreduce_gradients")
    sparse_lib.check_spec(sparse_rows, sparse_max_rows, axis_name, compression,
                          weight_key is not None, "allreduce_gradients")
    # A weighted mean sums the products w * g and divides after (weighted.py).
    op = "mean" if average and not weight_key else "sum"
    exact = set()  # ids of the buffers that must cross without a codec

    def reduce(buffer):
        if id(buffer) in exact:
            return (allreduce(buffer, op="sum") if axis_name is None
                    else psum(buffer, axis_name))
        if feedback and is_f32(buffer):
            # The reduced buffer and what this process's encoding lost.
            axes = None if axis_name is None else _psum_axes(axis_name)
            [out], [lost] = _allreduce.bind_with_loss([buffer], op=op, axes=axes,
                                                      codec=compression)
            return out, lost
        if axis_name is None:
            return allreduce(buffer, op=op, codec=compression)
        return (pmean if op == "mean" else psum)(buffer, axis_name, codec=compression)

    def init_fn(params):
        if not feedback:
            return AllReduceGradientsState()
        return CompressedGradientsState(residual=zero_residual(params))

    def update_fn(updates, state, params=None, **extra_args):
        del params
        w = step_weight(weight_key, extra_args, "allreduce_gradients")
        check_gradients(updates, axis_name, "allreduce_gradients", average=average)
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        sparse_at, sparse_sums = [], []
        if sparse_rows is None:
            sparse_lib.refuse_ids(extra_args, "allreduce_gradients")
        else:
            # Row-sparse leaves go through sparse_rows.py; the others below.
            flags = sparse_lib.leaf_flags(sparse_rows, updates, "allreduce_gradients")
            sparse_at = [i for i, f in enumerate(flags) if f]
            ids = sparse_lib.step_ids(extra_args, len(sparse_at), "allreduce_gradients")
            sparse_sums = sparse_lib.reduce([leaves[i] for i in sparse_at], ids,
                                            mean=op == "mean", max_rows=sparse_max_rows)
            leaves = [g for i, g in enumerate(leaves) if not flags[i]]
        ready = jax_compat.production_order(leaves)
        residual = treedef.flatten_up_to(state.residual) if feedback else None
        leaves = before_reduction(leaves, w, residual)
        grads = leaves
        if w is not None and compression == "none":
            # The weight operand rides in a float32 buffer: ready before any
            # gradient (-1), it joins the first one.
            leaves = leaves + [weighted.weight_operand(w)]
            ready = None if ready is None else ready + [-1]
        buckets = plan_buckets(leaves, fusion_bytes, first_bucket_bytes, ready,
                               servers_pay=compression == "none")
        buffers = fusion.pack(leaves, buckets)
        if w is not None and compression != "none":
            # A codec would bend the weight: a reduction of its own, exact.
            buffers.append(weighted.weight_operand(w))
            exact.clear()
            exact.add(id(buffers[-1]))
        # On XLA:CUDA every bucket's start comes before any bucket's done (the
        # host wait), so the whole backward pass is enqueued first; on XLA:CPU
        # this is one asynchronous call per bucket, in place, and one join
        # before the update (lowering.join_cpu).
        reduced = split_reductions(reduce, buffers)
        if w is not None and compression != "none":
            total = reduced[-1]
            reduced, buffers = reduced[:-1], buffers[:-1]
        if feedback:
            # What the engine's encoding of each float32 buffer lost, where
            # this process encoded it (engine::ReduceRequest::lost); a
            # non-finite loss (an overflow) is kept as zero, so that it does
            # not poison the steps after it.
            lost = [r[1] if is_f32(b) else b for r, b in zip(reduced, buffers)]
            reduced = [r[0] if is_f32(b) else r for r, b in zip(reduced, buffers)]
        sums = fusion.unpack(reduced, buckets, leaves)
        if w is not None:
            if compression == "none":
                total, sums = sums[-1], sums[:-1]
            weighted.check_total_eagerly(total, "allreduce_gradients")
            sums = [weighted.divided(s, total) for s in sums]
        for i, r in zip(sparse_at, sparse_sums):
            sums.insert(i, r)
        out = jax.tree_util.tree_unflatten(treedef, sums)
        if not feedback:
            return out, state
        kept = fusion.unpack(lost, buckets, grads)
        residual = [k if is_f32(g) else e for k, g, e in zip(kept, grads, residual)]
        return out, CompressedGradientsState(jax.tree_util.tree_unflatten(treedef, residual))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def weight_keyword(weight, average: bool, api: str) -> str | None:
    """The update's keyword that carries the weight (None: unweighted), from
    a transformation's `weight` argument (False, True or a keyword name)."""
    if weight is False or weight is None:
        return None
    if weight is not True and not (isinstance(weight, str) and weight.isidentifier()):
        raise TypeError(f"herring_jax.{api}: weight must be True (the update takes weight=w), "
                        f"False, or the name of the update's keyword that carries it; got "
                        f"{weight!r}. The weight itself is passed at every step: "
                        "tx.update(grads, state, params, weight=w)")
    if not average:
        raise ValueError(f"herring_jax.{api}: weight= needs average=True (the weighted mean "
                         "sum(w_i g_i) / sum(w_i)); for a weighted sum multiply the gradients "
                         "by the weight before the transformation")
    return "weight" if weight is True else weight


def step_weight(key: str | None, extra_args: dict, api: str, supported: bool = True):
    """This step's weight from the update's extra arguments, checked; None
    for an unweighted transformation (which refuses a weight= it would
    otherwise drop without a word; `supported`: whether `api` has weight=)."""
    if key is None:
        if "weight" in extra_args and supported:
            raise TypeError(f"herring_jax.{api}: the update got weight= but the transformation "
                            f"was built unweighted, and would ignore it: build it with "
                            f"herring_jax.{api}(..., weight=True)")
        if "weight" in extra_args:
            raise TypeError(f"herring_jax.{api} does not take a weight (a weighted mean of the "
                            "gradients), and would ignore the update's weight=: weight "
                            "with herring_jax.allreduce_gradients(weight=True) or "
                            "sharded_optimizer(..., weight=True), or leave weight= out")
        return None
    if key not in extra_args:
        raise TypeError(f"herring_jax.{api}(weight=...) needs this step's weight: "
                        f"tx.update(grads, state, params, {key}=w), w a scalar such as the "
                        "examples this process used (optax.chain hands it on)")
    return weighted.check_weight(extra_args[key], f"herring_jax.{api}")


def _psum_axes(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
