"""fully_sharded: parameters, gradients and optimizer state at 1/N on every
process (ZeRO stage 3 / FSDP on herring's parameter servers).

Between steps each of the N processes holds chunk r of every parameter (the
layout of sharded_optimizer, chunks.py) and the inner optimizer's state over
those chunks. Inside the jitted step:

- forward: the parameters are gathered bucket by bucket in the order the
  loss first uses them (found by tracing it), each bucket one all-gather,
  issued ahead of the layers that need it: XLA:CPU starts an asynchronous
  call as soon as its operands exist, so at most `prefetch` gathers are let
  run ahead of the one the forward pass waits for (bucket k's gather takes a
  data dependence on the arrival of buckets 0 .. k - prefetch - 1); None
  lets every gather start at once;
- backward: each bucket's gather transposes to one reduce-scatter of its
  gradients (mean or sum, a codec with error feedback where asked), issued
  as soon as the backward pass has produced them, none waiting for another
  (the forward pass's prefetch bound has no transpose); each process keeps
  only its chunk of every gradient;
- the inner transformation updates the chunks; there is no all-gather
  after the update (the next step's gathers are the only ones).

Per step that is the bytes of one all-reduce. With reshard_after_forward the
gathered buckets are not kept for the backward pass but gathered again there
(1.5x the bytes, the whole parameters never live at once through the step).

Every element is summed in the order allreduce_gradients sums it and the
inner transformation sees the same chunks as in sharded_optimizer, so for
element-wise inner transformations and the same gradients the parameters are
bitwise those of ``optax.chain(allreduce_gradients(), inner)`` (the
gradients are XLA's compilation of the loss: bitwise those of the same loss
in a one-device jax.jit, not always those of a jax.shard_map program;
docs/guides/fully_sharded.md, "Same results").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from herring_jax._src.collectives import allreduce as _allreduce
from herring_jax._src.collectives import codecs
from herring_jax._src.collectives import composite
from herring_jax._src.collectives import reduce_scatter as _reduce_scatter_mod
from herring_jax._src.collectives import reshard
from herring_jax._src.process import runtime
from herring_jax._src.transforms import sharded_checks
from herring_jax._src.transforms.sharded_checks import global_sum
from herring_jax._src.transforms.chunks import BucketLayout, chunk_of, from_rows, to_rows
from herring_jax._src.transforms.optax_transform import check_bucket_sizes, plan_buckets


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FullyShardedState:
    """What each process holds between steps of ``fully_sharded``.

    Attributes:
      chunks: this process's chunk of every parameter (the parameters' tree;
        each leaf ceil(size / N) elements on its last axis, as
        ``sharded_optimizer``'s inner sees them).
      inner: the inner transformation's state over the chunks.
      residual: with a lossy ``compression`` and error feedback, what this
        process's gradients lost so far (whole-sized float32 leaves); else ().
      shard: this process's rank (int32): which chunk it holds.
      shapes: (static) each parameter's whole shape and dtype.
    """

    chunks: Any
    inner: Any
    residual: Any
    shard: Any
    shapes: tuple = dataclasses.field(metadata=dict(static=True), default=())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FullyShardedGrads:
    """``fully_sharded``'s gradients: this process's chunk of every averaged
    gradient, and the error feedback's new residual (or ())."""

    chunks: Any
    residual: Any


class FullySharded:
    """Parameters, gradients and optimizer state sharded over the processes.

    Made by ``herring_jax.fully_sharded``; see there.
    """

    def __init__(self, inner, *, fusion_bytes, first_bucket_bytes, prefetch,
                 reshard_after_forward, compression, error_feedback, average, check_inner):
        check_bucket_sizes(fusion_bytes, first_bucket_bytes)
        codecs.check_codec(compression)
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int)
                                     or prefetch < 0):
            raise ValueError(f"fully_sharded: prefetch must be an int >= 0 (the gathers let run "
                             f"ahead of the one the forward pass waits for; 0: none) or None "
                             f"(every gather at once), got {prefetch!r}")
        self.inner = inner
        self.fusion_bytes = fusion_bytes
        self.first_bucket_bytes = first_bucket_bytes
        self.prefetch = prefetch
        self.reshard_after_forward = bool(reshard_after_forward)
        self.compression = compression
        self.feedback = bool(error_feedback) and compression != "none"
        self.op = "mean" if average else "sum"
        self.check_inner = check_inner
        self._align = codecs.BLOCK if compression != "none" else 1

    # -- between steps -------------------------------------------------------

    def init(self, params) -> FullyShardedState:
        """This process's chunks of `params` (whole, the same on every
        process) and the inner state over them. Works eagerly and under
        ``jax.jit`` (the same program on every process)."""
        _check_floating(params)
        n = runtime.process_count()
        shard = jnp.asarray(_reduce_scatter_mod.shard_index(), jnp.int32)
        if self.check_inner:
            sharded_checks.check_elementwise(self.inner, params, max(n, 2))
        leaves, treedef = jax.tree_util.tree_flatten(params)
        shapes = tuple((tuple(np.shape(p)), np.dtype(p.dtype).name) for p in leaves)
        chunks = jax.tree_util.tree_unflatten(treedef, [chunk_of(p, n, shard) for p in leaves])
        with sharded_checks.global_norms(global_sum(None)):
            inner_state = self.inner.init(chunks)
        residual = ()
        if self.feedback:
            residual = jax.tree_util.tree_unflatten(treedef, [
                jnp.zeros(s if d == "float32" else (), jnp.float32) for s, d in shapes])
        return FullyShardedState(chunks, inner_state, residual, shard, shapes)

    def gather(self, state: FullyShardedState, order=None):
        """The whole parameters from every process's chunks (all-gathers,
        bucket by bucket). Differentiable with respect to ``state.chunks``:
        the transpose reduce-scatters the cotangents (``average``: their
        mean), so each process gets its chunk of the gradient; with a lossy
        ``compression`` its error feedback applies through
        ``value_and_grad`` only."""
        leaves, treedef = jax.tree_util.tree_flatten(state.chunks)
        if len(leaves) != len(state.shapes):
            raise ValueError(f"fully_sharded.gather: the state holds {len(leaves)} chunks for "
                             f"{len(state.shapes)} parameters; pass the state init made")
        # Error feedback needs its new residual out of the backward pass:
        # value_and_grad does that; a gradient taken through gather alone is
        # compressed without it.
        whole = self._gather(leaves, None, None, state.shapes, order)
        return jax.tree_util.tree_unflatten(treedef, whole)

    def apply_gradients(self, state: FullyShardedState, grads: FullyShardedGrads
                        ) -> FullyShardedState:
        """The inner transformation's step on the chunks."""
        with sharded_checks.global_norms(global_sum(None)):
            updates, inner_state = self.inner.update(grads.chunks, state.inner, state.chunks)
        chunks = optax.apply_updates(state.chunks, updates)
        residual = grads.residual if self.feedback else state.residual
        return dataclasses.replace(state, chunks=chunks, inner=inner_state, residual=residual)

    def value_and_grad(self, fun: Callable, has_aux: bool = False) -> Callable:
        """``jax.value_and_grad`` of ``fun(params, *args)`` taken through the
        sharding: the returned function takes ``(state, *args,
        accumulate=None)``, gathers the parameters (in the order `fun` first
        uses them), and returns ``(value, FullyShardedGrads)``
        (``((value, aux), grads)`` with `has_aux`).

        Each call reduce-scatters its gradients once. Several calls in one
        step (gradient accumulation) pass the previous call's grads as
        `accumulate`: the result holds the sum of their chunks and this
        call's, and with error feedback this call's reduction adds the
        residual the previous one left (not the state's again), so each
        loss is added back once, by the next reduction. Calls given the same
        state without `accumulate` would each add the state's residual."""

        def run(state: FullyShardedState, *args, accumulate: FullyShardedGrads | None = None):
            if accumulate is not None and not isinstance(accumulate, FullyShardedGrads):
                raise TypeError(
                    f"fully_sharded.value_and_grad: accumulate must be the FullyShardedGrads "
                    f"of an earlier call of this step (or fs.zero_gradients(state)), got "
                    f"{type(accumulate).__name__}")
            order = self._forward_order(fun, state, args)
            treedef = jax.tree_util.tree_structure(state.chunks)
            # A job of one process encodes nothing: no residual to carry.
            feedback = self.feedback and runtime.process_count() > 1
            carried = state.residual if accumulate is None else accumulate.residual
            residual = treedef.flatten_up_to(carried) if feedback else None

            # With error feedback the new residual leaves the backward pass
            # as the "gradient" of `sinks`, zeros the gathers take and never
            # read (the reduce-scatter computes it where the whole gradient
            # exists); the old residual goes in as a value.
            def of_chunks(chunks, sinks):
                whole = self._gather(treedef.flatten_up_to(chunks), residual, sinks,
                                     state.shapes, order)
                if self.reshard_after_forward:
                    # What is computed from the gathered buckets alone is
                    # recomputed in the backward pass too (reshard.py).
                    return reshard.evaluate(
                        lambda p, *a: fun(jax.tree_util.tree_unflatten(treedef, p), *a),
                        whole, args)
                return fun(jax.tree_util.tree_unflatten(treedef, whole), *args)

            if self.reshard_after_forward:
                of_chunks = jax.checkpoint(of_chunks, policy=_all_but_gathers)
            sinks = jax.tree_util.tree_map(jnp.zeros_like, residual) if feedback else None
            value, (g_chunks, g_sinks) = jax.value_and_grad(
                of_chunks, argnums=(0, 1), has_aux=has_aux)(state.chunks, sinks)
            new_residual = (jax.tree_util.tree_unflatten(treedef, g_sinks) if feedback
                            else carried)
            if accumulate is not None:
                g_chunks = jax.tree_util.tree_map(jnp.add, accumulate.chunks, g_chunks)
            return value, FullyShardedGrads(g_chunks, new_residual)

        return run

    def zero_gradients(self, state: FullyShardedState) -> FullyShardedGrads:
        """Gradients of nothing yet: zero chunks and the state's residual, the
        `accumulate` of a step's first ``value_and_grad`` call (for a
        ``jax.lax.scan`` over microbatches, whose carry needs it from the
        start)."""
        return FullyShardedGrads(jax.tree_util.tree_map(jnp.zeros_like, state.chunks),
                                 state.residual)

    # -- inside the step -----------------------------------------------------

    def _forward_order(self, fun, state, args):
        """Where `fun` first uses each parameter: the position of the first
        equation of its traced program that reads it (never used: last)."""
        params = [jax.ShapeDtypeStruct(s, d) for s, d in state.shapes]
        treedef = jax.tree_util.tree_structure(state.chunks)
        # The other arguments as they are (Python values stay static, as in
        # the step itself).
        closed = jax.make_jaxpr(
            lambda p: fun(jax.tree_util.tree_unflatten(treedef, p), *args))(params)
        invars = closed.jaxpr.invars[:len(params)]
        never = len(closed.jaxpr.eqns)
        first = {id(v): never for v in invars}
        for k, eqn in enumerate(closed.jaxpr.eqns):
            for v in eqn.invars:
                if first.get(id(v)) == never:
                    first[id(v)] = k
        return [first[id(v)] for v in invars]

    def _gather(self, leaves, residual, sinks, shapes, order):
        n = runtime.process_count()
        stand_ins = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
        # Buckets in forward order: the first (small) bucket is the first
        # the forward pass needs.
        ready = order if order is not None else list(range(len(leaves)))
        buckets = plan_buckets(stand_ins, self.fusion_bytes, self.first_bucket_bytes, ready)
        out = [None] * len(leaves)
        for i, (s, d) in enumerate(shapes):
            if not np.prod(s, dtype=np.int64):
                out[i] = jnp.zeros(s, d)
        gathered = []
        released = None
        for k, bucket in enumerate(buckets):
            lay = BucketLayout(bucket, n, self._align)
            ops = [leaves[i] for i in lay.leaves]
            if self.prefetch is not None and k > self.prefetch:
                # Not before bucket k - prefetch - 1 has arrived, nor before
                # bucket k-1 was let go (so, in order, not before every
                # bucket up to k - prefetch - 1 has arrived): while the
                # forward pass waits for bucket j, buckets j+1 .. j+prefetch
                # may be in flight, no more.
                ops = _after(ops, (gathered[k - self.prefetch - 1], released))
            released = ops
            res = sink = None
            if residual is not None and lay.dtype == np.float32:
                res = [residual[i] for i in lay.leaves]
                if sinks is not None:
                    sink = [sinks[i] for i in lay.leaves]
            whole = self._gather_bucket(lay, [shapes[i][0] for i in lay.leaves], ops, res, sink)
            gathered.append(whole[0])
            for i, w in zip(lay.leaves, whole):
                out[i] = w
        return out

    def _gather_bucket(self, lay, shapes, chunks, residual, sinks):
        """One bucket's all-gather as one equation (composite.py): the chunks
        in, the whole leaves out; its transpose the reduce-scatter, whose
        error feedback adds `residual` (operands the composite passes to the
        transpose as values, never differentiated) and writes what this
        process's contribution lost as the sinks' cotangents."""
        n, op, codec = lay.n, self.op, self.compression
        count = len(chunks)
        sinks, residual = sinks or [], residual or []
        operands = list(chunks) + sinks + residual
        known_at = tuple(range(count + len(sinks), len(operands)))

        if codec == "none":
            return self._gather_leaves(n, shapes, chunks)

        def body(*xs):
            row = lay.join(list(xs[:count]))
            [rows] = _allreduce.bind([row], op="sum", axes=None, collective="all_gather")
            return [v.reshape(s) for v, s in zip(lay.unpack(rows.reshape(-1), n), shapes)]

        def transpose(cts, avals, known):
            old = [known[i] for i in known_at]
            buffer = lay.pack([ct + e for ct, e in zip(cts, old)] if old else cts)
            rows = buffer.reshape(n, -1)
            leaf_codec = _allreduce.leaf_codec(buffer, codec)
            if not sinks:
                [part] = _allreduce.bind([rows], op=op, axes=None, codec=leaf_codec,
                                         collective="reduce_scatter")
            else:
                # What the engine's encoding lost of what this process
                # encoded (engine::ReduceRequest::lost): its own contribution
                # where it crosses the wire, its slices of its host's float32
                # sum where the host stage sums first, zeros where nothing
                # was encoded (one host).
                [part], [lost] = _allreduce.bind_with_loss([rows], op=op, axes=None,
                                                           codec=leaf_codec,
                                                           collective="reduce_scatter")
            grads = [c.reshape(a.shape) for c, a in zip(lay.split(part), avals[:count])]
            if not sinks:
                return grads + [None] * len(residual)
            return (grads + [v.reshape(s) for v, s in zip(lay.unpack(lost.reshape(-1), n),
                                                           shapes)]
                    + [None] * len(residual))

        return composite.bind("all_gather", body, operands, transpose=transpose,
                              nondiff=known_at)

    def _gather_leaves(self, n, shapes, chunks):
        """A bucket without a codec: one call with an operand per leaf, so
        that each leaf's rows arrive contiguous (no buffer to pack, nor one to
        cut into leaves: fewer temporaries in the step)."""
        op = self.op

        def body(*xs):
            rows = _allreduce.bind([x.reshape(-1) for x in xs], op="sum", axes=None,
                                   collective="all_gather")
            return [from_rows(r, s) for r, s in zip(rows, shapes)]

        def transpose(cts, avals, known):
            del known
            parts = _allreduce.bind([to_rows(ct, n) for ct in cts], op=op, axes=None,
                                    collective="reduce_scatter")
            return [p.reshape(a.shape) for p, a in zip(parts, avals)]

        return composite.bind("all_gather", body, list(chunks), transpose=transpose)


@jax.custom_jvp
def _after(ops, anchor):
    """`ops`, not computed before `anchor` exists (the forward pass's
    prefetch bound)."""
    ops, _ = jax.lax.optimization_barrier((ops, anchor))
    return ops


@_after.defjvp
def _after_jvp(primals, tangents):
    # The tangents pass through untouched: jax's own rule puts a barrier on
    # them too, whose transpose would make bucket k - prefetch - 1's
    # reduce-scatter wait for bucket k's (and fill in a zero cotangent of
    # the anchor's whole size per bucket). The backward pass issues each
    # reduce-scatter as soon as its gradients exist instead.
    ops, anchor = primals
    return _after(ops, anchor), tangents[0]


def _check_floating(params) -> None:
    """Refuses integer and bool leaves at init: value_and_grad differentiates
    every parameter the state holds, and jax gives them no gradient (its
    error would ask for an allow_int the user cannot pass)."""
    shown = _allreduce.non_floating_leaves(params)
    if shown:
        raise TypeError(
            f"herring_jax.fully_sharded: the parameters {shown} are not floating point, and "
            "fully_sharded differentiates every parameter it holds (integer and bool leaves "
            "have no gradient). They are usually state rather than trainable parameters: "
            "keep them out of the tree given to init (nnx.split(model, nnx.Param, ...) "
            "splits them off) and pass them to the loss beside the state, or cast them to "
            "float.")


def _all_but_gathers(prim, *_, **__) -> bool:
    """reshard_after_forward's remat policy: keep every value of the forward
    pass but the gathered parameters (gathered again for the backward) and
    what is computed from them alone (reshard.py binds it as all_gather)."""
    return str(prim) != "all_gather"


def fully_sharded(inner: optax.GradientTransformation, *, prefetch: int | None = 2,
                  reshard_after_forward: bool = False, fusion_bytes: int | None = None,
                  first_bucket_bytes: int | None = None, compression: str = "none",
                  error_feedback: bool = True, average: bool = True,
                  check_inner: bool = True, weight=None) -> FullySharded:
    """Trains with parameters, gradients and `inner`'s state sharded over the
    processes (ZeRO-3 / FSDP on herring's parameter servers).

    Each of the N processes holds 1/N of every parameter and of `inner`'s
    state between steps; inside the step the parameters are all-gathered
    bucket by bucket ahead of the layers that use them, and the gradients
    reduce-scattered bucket by bucket as the backward pass produces them:
    the bytes of one all-reduce per step, and no all-gather after the update.

    Use::

        fs = herring_jax.fully_sharded(optax.adamw(1e-3))
        state = fs.init(params)                 # params whole, as for any optax chain

        @jax.jit
        def train_step(state, batch):
            loss, grads = fs.value_and_grad(loss_fn)(state, batch)  # loss_fn(params, batch)
            return fs.apply_gradients(state, grads), loss

        params = fs.gather(state)               # the whole parameters (eval, export)

    `inner` must treat its leaves element by element, as for
    ``sharded_optimizer`` (``init`` checks it, as there); global norms
    (``optax.clip_by_global_norm``) see the whole gradient. For element-wise
    `inner`, the parameters are bitwise those of
    ``optax.chain(allreduce_gradients(), inner)`` in a one-device
    ``jax.jit`` (a ``jax.shard_map`` step compiles the loss otherwise, and
    its gradients may differ in their last bits).

    Args:
      inner: the optax transformation that updates the chunks.
      prefetch: how many gathers may run ahead of the one the forward pass
        waits for (FSDP2 keeps two in flight; 0: each gather waits for the
        one before it to arrive); None: every gather starts at once (the most
        overlap, all gathered buckets allocated together). It bounds the
        forward pass only: each reduce-scatter of the backward pass starts
        as soon as its gradients exist.
      reshard_after_forward: gather every bucket again in the backward pass
        instead of keeping it from the forward pass, and recompute there what
        the loss computes from the parameters alone (casts, transposes):
        1.5x the bytes; lower peak memory.
      fusion_bytes, first_bucket_bytes: bucket sizes, as for
        ``allreduce_gradients`` (the first bucket is the first layers').
      compression: wire codec of the gradients' reduce-scatter (``"none"``,
        ``"bf16"``, ``"fp16"``, ``"int8"``); the gathers carry parameters
        exactly, in their dtype.
      error_feedback: with a lossy codec, add what this process's gradients
        lost to the next reduction's (a whole-sized float32 residual per
        leaf; zeros where nothing this process sends is encoded: one
        process, one host through the host stage). Gradient accumulation:
        ``value_and_grad``'s `accumulate`.
      average: mean (True) or sum (False) of the processes' gradients.
      check_inner: run the element-wise check at init.
      weight: not supported: a weighted mean of the gradients (as
        ``allreduce_gradients(weight=True)``) is not built into
        ``fully_sharded`` yet, and any value but None raises ValueError
        saying how to get one (docs/guides/weighted.md).

    Returns:
      A ``FullySharded`` with ``init``, ``value_and_grad``,
      ``apply_gradients`` and ``gather``.
    """
    if weight is not None:
        raise ValueError(
            "herring_jax.fully_sharded does not take weight= (a weighted mean of the "
            "gradients) yet. Either use herring_jax.sharded_optimizer(inner, weight=True) or "
            "allreduce_gradients(weight=True), which do; or, with fully_sharded(..., "
            "average=False), differentiate w * loss (w: this process's weight) and divide "
            "the gradients' chunks by herring_jax.allreduce(w) before apply_gradients (the "
            "same mean, rounded differently)")
    return FullySharded(inner, fusion_bytes=fusion_bytes, first_bucket_bytes=first_bucket_bytes,
                        prefetch=prefetch, reshard_after_forward=reshard_after_forward,
                        compression=compression, error_feedback=error_feedback, average=average,
                        check_inner=check_inner)
