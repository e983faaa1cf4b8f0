"""sharded_optimizer: an optax transformation whose state, and whose update,
cover only the part of every parameter this process serves (ZeRO stage 1 on
herring's parameter servers).

Every worker of N (processes, or devices of a mesh axis) owns chunk r of every
leaf: its flattened elements [r*c, (r+1)*c), c = ceil(size / N), the last
chunks padded with zeros to c. A step packs the gradients into fusion
buffers as allreduce_gradients does (production order, buckets issued during
the backward pass), but lays each buffer out worker by worker (every leaf's
chunk 0, then every leaf's chunk 1, ...), so that one reduce-scatter of the
buffer leaves worker r holding exactly the averaged chunks r of its leaves.
The inner transformation updates those chunks (its state holds chunks only),
and one all-gather per buffer of the resulting updates gives every worker the
whole update: the same bytes as one all-reduce, 1/N of the optimizer's memory
and work.

The chunk of a leaf does not depend on which buffer it travels in, so the
state's layout is fixed at init, whatever order the backward pass produces
the gradients in; and every element is summed as allreduce_gradients sums it,
so for element-wise inner transformations the parameters are bitwise those of
``optax.chain(allreduce_gradients(), inner)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from herring_jax._src.collectives import allreduce as _allreduce
from herring_jax._src.collectives import codecs
from herring_jax._src.process import jax_compat
from herring_jax._src.collectives import reduce_scatter as _reduce_scatter_mod
from herring_jax._src.process import runtime
from herring_jax._src.transforms import sharded_checks
from herring_jax._src.transforms import sparse_rows as sparse_lib
from herring_jax._src.collectives import weighted
from herring_jax._src.transforms.sharded_checks import global_sum
from herring_jax._src.transforms.chunks import BucketLayout, chunk_of, chunk_shape
from herring_jax._src.transforms.optax_transform import (before_reduction, check_bucket_sizes,
                                                         plan_buckets, step_weight,
                                                         weight_keyword, zero_residual)
from herring_jax._src.collectives.psum import check_axes_bound, check_gradients, psum
from herring_jax._src.collectives.split import split_reductions


class ShardedOptimizerState(NamedTuple):
    """The state of ``sharded_optimizer``.

    Attributes:
      inner: the inner transformation's state, over this worker's chunks:
        every leaf that mirrors a parameter holds ceil(size / N) elements.
      shard: this worker's index among the N (int32): which chunk of every
        leaf it owns. Inside ``jax.shard_map`` every leaf of the state has a
        leading axis of one per device (shard the state over the axis).
      residual: with a lossy ``compression`` and error feedback, what this
        worker's contributions lost so far (one array per float32 gradient
        leaf, whole-sized: each worker's own); else ().
    """

    inner: Any
    shard: Any
    residual: Any


def sharded_optimizer(inner: optax.GradientTransformation, axis_name=None, *,
                      average: bool = True, fusion_bytes: int | None = None,
                      first_bucket_bytes: int | None = None, compression: str = "none",
                      error_feedback: bool = True, check_inner: bool = True,
                      weight: bool | str = False, sparse_rows=None
                      ) -> optax.GradientTransformationExtraArgs:
    """Runs `inner` on the part of every parameter this worker serves.

    Use it in place of ``optax.chain(herring_jax.allreduce_gradients(), inner)``:
    the gradients are reduce-scattered, so that each of the N workers holds the
    average of its chunk (1/N) of every leaf; `inner` updates those chunks,
    its state holding only them; the updates are all-gathered, so every
    worker applies the whole, identical update. The same bytes cross as with
    allreduce_gradients, and each worker keeps and computes 1/N of the
    optimizer.

    `inner` must treat its leaves element by element (sgd, momentum, adam,
    adamw, lion, rmsprop, schedules, masks, ...): then the parameters are
    bitwise those of the unsharded chain. ``optax.tree.norm`` (and so
    ``optax.clip_by_global_norm``) inside `inner` sees the whole gradient: the
    workers' partial sums of squares are added in a fixed order, which may
    differ from ``optax.tree.norm`` of the whole gradient in the last bits. A
    transformation that looks at a whole leaf (LAMB's or LARS's trust ratios,
    adafactor's factored moments, Muon) or at every gradient at once
    (``apply_if_finite``) would be wrong on chunks: ``init`` checks `inner`
    on small stand-in parameters and raises ValueError if its updates on
    chunks differ from those on whole leaves.

    Args:
      inner: the optax transformation to shard (an ``optax.chain`` is fine).
      axis_name: None: the workers are the processes (one device each,
        Horovod style). A mesh axis name (or tuple): the devices of that axis
        inside ``jax.shard_map(..., check_vma=False)``; the state then has a
        leading axis of one per device: shard it over `axis_name`.
      average: mean (True) or sum (False) of the workers' gradients.
      fusion_bytes, first_bucket_bytes: as for ``allreduce_gradients``, but
        the default stays a sixteenth with server-only processes (the
        global norm's sum follows the buckets: the servers change no bit).
      compression: wire codec of the reduce-scatter (``"none"``, ``"bf16"``,
        ``"fp16"``, ``"int8"``); the all-gather carries updates exactly.
      error_feedback: with a lossy codec, add what encoding lost to the next
        gradients, as ``allreduce_gradients`` does (the engine reports what
        this worker encoded; the residual is whole-sized).
      check_inner: run the element-wise check at init (see above).
      weight: True: a weighted mean of the gradients, as
        ``allreduce_gradients(weight=True)``: every step passes this worker's
        weight, ``tx.update(grads, state, params, weight=w)``; the chunks are
        bitwise those of the weighted unsharded chain. The total weight is
        one more small exact reduction per step. A string names the keyword.
      sparse_rows: not supported here yet (``NotImplementedError``): reduce
        row-sparse leaves with ``optax.chain(herring_jax.allreduce_gradients(
        sparse_rows=...), inner)``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with
      ``ShardedOptimizerState``.

    Examples:
      >>> tx = herring_jax.sharded_optimizer(
      ...     optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))
      >>> opt_state = tx.init(params)                                 # doctest: +SKIP
      >>> updates, opt_state = tx.update(grads, opt_state, params)    # doctest: +SKIP
    """
    check_bucket_sizes(fusion_bytes, first_bucket_bytes)
    codecs.check_codec(compression)
    if sparse_rows is not None:
        raise NotImplementedError(
            "herring_jax.sharded_optimizer does not take sparse_rows yet (its reduce-scatter "
            "cuts every leaf into equal chunks, not rows): use optax.chain("
            "herring_jax.allreduce_gradients(sparse_rows=...), inner) for row-sparse leaves")
    feedback = error_feedback and compression != "none"
    weight_key = weight_keyword(weight, average, "sharded_optimizer")
    # A weighted mean sums the products w * g and divides after (weighted.py).
    op = "mean" if average and not weight_key else "sum"
    # With a codec each worker's part of a buffer starts at a block boundary.
    align = codecs.BLOCK if compression != "none" else 1

    def workers() -> int:
        return _workers(axis_name)

    def per_device(tree, add: bool):
        """Inside shard_map the state carries a leading axis of one."""
        if axis_name is None:
            return tree
        return jax.tree_util.tree_map(lambda x: x[None] if add else x[0], tree)

    def init_fn(params):
        check_axes_bound(axis_name, "sharded_optimizer")
        n = workers()
        # Never a constant of this process's rank under jit: every process
        # must compile the same program (reduce_scatter.shard_index).
        shard = (jax.lax.axis_index(axis_name) if axis_name is not None
                 else _reduce_scatter_mod.shard_index())
        shard = jnp.asarray(shard, jnp.int32)
        if check_inner:
            # As for 2 workers at least: a script tried on one process first
            # must fail there too, not only once it is scaled up.
            sharded_checks.check_elementwise(inner, params, max(n, 2))
        chunks = jax.tree_util.tree_map(lambda p: chunk_of(p, n, shard), params)
        with sharded_checks.global_norms(global_sum(axis_name)):
            inner_state = inner.init(chunks)
        residual = zero_residual(params) if feedback else ()
        return per_device(ShardedOptimizerState(inner_state, shard, residual), add=True)

    def update_fn(updates, state, params=None, **extra_args):
        w = step_weight(weight_key, extra_args, "sharded_optimizer")
        if sparse_lib.IDS_KEYWORD in extra_args:
            raise TypeError(f"herring_jax.sharded_optimizer got {sparse_lib.IDS_KEYWORD}= "
                            "but takes no row-sparse leaves, and would ignore it: use "
                            "optax.chain(herring_jax.allreduce_gradients(sparse_rows=...), "
                            "inner), or leave it out")
        check_gradients(updates, axis_name, "sharded_optimizer", average=average)
        state = per_device(state, add=False)
        n = workers()
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        ready = jax_compat.production_order(leaves)
        residual = treedef.flatten_up_to(state.residual) if feedback else None
        leaves = before_reduction(leaves, w, residual)
        buckets = plan_buckets(leaves, fusion_bytes, first_bucket_bytes, ready)
        layouts = [BucketLayout(b, n, align) for b in buckets]
        buffers = [lay.pack([leaves[i] for i in lay.leaves]) for lay in layouts]
        # Every bucket's reduce-scatter is issued as soon as its gradients
        # exist (on XLA:CUDA every start before any done), as
        # allreduce_gradients issues its reductions.
        # The total weight: every worker needs all of it, so it is a small
        # exact all-reduce of its own, not a reduce-scatter, issued with them.
        operand = [] if w is None else [weighted.weight_operand(w)]

        def reduce(b):
            if operand and b is operand[0]:
                return _total(b, axis_name)
            return _reduce_scatter(b, axis_name, op, compression,
                                   feedback and b.dtype == np.float32)

        parts = split_reductions(reduce, buffers + operand)
        if operand:
            total, parts = parts[-1], parts[:-1]
        if feedback:
            # What the engine's encoding of each float32 buffer lost, where
            # this worker encoded it (see allreduce_gradients).
            lost = [p[1] if b.dtype == np.float32 else b for p, b in zip(parts, buffers)]
            parts = [p[0] if b.dtype == np.float32 else p for p, b in zip(parts, buffers)]
        # The chunks this worker serves, averaged, in the inner's shapes.
        grad_chunks = [jnp.zeros(chunk_shape(np.shape(g), n), g.dtype) for g in leaves]
        for lay, part in zip(layouts, parts):
            for i, chunk in zip(lay.leaves, lay.split(part)):
                grad_chunks[i] = chunk.reshape(chunk_shape(np.shape(leaves[i]), n))
        if w is not None:
            weighted.check_total_eagerly(total, "sharded_optimizer")
            grad_chunks = [weighted.divided(c, total) for c in grad_chunks]
        param_chunks = None
        if params is not None:
            param_chunks = jax.tree_util.tree_map(lambda p: chunk_of(p, n, state.shard), params)
        with sharded_checks.global_norms(global_sum(axis_name)):
            update_chunks, inner_state = inner.update(
                jax.tree_util.tree_unflatten(treedef, grad_chunks), state.inner, param_chunks)
        update_chunks = treedef.flatten_up_to(update_chunks)
        out = [jnp.zeros(np.shape(g), u.dtype) for g, u in zip(leaves, update_chunks)]
        # One all-gather for every bucket: the updates exist together, and
        # one call synchronizes a host's processes once, not once a bucket.
        gathered = _all_gather([lay.join([update_chunks[i] for i in lay.leaves])
                                for lay in layouts], axis_name)
        for lay, rows in zip(layouts, gathered):
            for i, value in zip(lay.leaves, lay.unpack(rows, n)):
                out[i] = value.reshape(np.shape(leaves[i]))
        new_state = ShardedOptimizerState(inner_state, state.shard, state.residual)
        if feedback:
            kept = list(residual)
            for lay, loss in zip(layouts, lost):
                if lay.dtype != np.float32:
                    continue
                for i, value in zip(lay.leaves, lay.unpack(loss, n)):
                    kept[i] = value.reshape(np.shape(leaves[i]))
            new_state = new_state._replace(residual=jax.tree_util.tree_unflatten(treedef, kept))
        return jax.tree_util.tree_unflatten(treedef, out), per_device(new_state, add=True)

    # What save_sharded / restore_sharded need to know of the state.
    init_fn.sharded_inner = inner
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _total(operand, axis_name):
    """The weight operand summed over the workers, exactly."""
    if axis_name is None:
        [total] = _allreduce.bind([operand], op="sum", axes=None)
        return total
    return psum(operand, axis_name)


def _axes(axis_name):
    """The reduced axes as the primitive takes them (None: the processes)."""
    if axis_name is None:
        return None
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _reduce_scatter(buffer, axis_name, op: str, codec: str, feedback: bool = False):
    """This worker's row of the (n, width) buffer, reduced (mean or sum) over
    the workers: the first half of herring's reduction. With `feedback`, also
    what this worker's encoding lost (the buffer's shape)."""
    n = _workers(axis_name)
    if feedback:
        [row], [lost] = _allreduce.bind_with_loss([buffer.reshape(n, -1)], op=op,
                                                  axes=_axes(axis_name), codec=codec,
                                                  collective="reduce_scatter")
        return row, lost.reshape(buffer.shape)
    [row] = _allreduce.bind([buffer.reshape(n, -1)], op=op, axes=_axes(axis_name), codec=codec,
                            collective="reduce_scatter")
    return row


def _all_gather(rows: list, axis_name) -> list:
    """For each of this worker's rows, every worker's, stacked: the whole
    (n * width) buffers (the second half, exact), in one call."""
    if not rows:
        return []
    gathered = _allreduce.bind(rows, op="sum", axes=_axes(axis_name), collective="all_gather")
    return [g.reshape(-1) for g in gathered]


def _workers(axis_name) -> int:
    if axis_name is None:
        return runtime.process_count()
    return int(jax.lax.axis_size(axis_name))
