"""split_reductions: allreduce_gradients' reductions as a start per bucket,
then the rest of every bucket's reduction after all the starts.

On XLA:CUDA a reduction lowers to a start and a done (lowering.py), and the
done blocks XLA's host thread until the sum is back. Were a bucket's done free
to be scheduled right after its start, the host would stop enqueuing the
backward pass there and the GPU would run dry. So every bucket's reduction is
traced twice: first only its start (allreduce_start_p, whose result is a
token), then the reduction itself (allreduce_p), which takes every start's
token, its own first. On XLA:CPU the start lowers to nothing and the tokens
are dropped: one asynchronous call per bucket, reducing in place, and all
their results then pass through one join_p before anything uses them
(lowering.join_cpu says why; tests/test_cuda_lowering.py checks both).

Both passes run the caller's `reduce` on the same buffers, so they bind the
same reductions in the same order, which pairs them; the first pass's results
are placeholders that nothing uses. The pairing is checked: each second-pass
reduction must have the parameters and operand types of its start.
"""

from __future__ import annotations

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from herring_jax._src.collectives import allreduce
from herring_jax._src.process import jax_compat
from herring_jax._src.collectives import lowering


def _signature(leaves, params):
    return (tuple(sorted(params.items(), key=lambda kv: kv[0])),
            tuple((tuple(jax.typeof(v).shape), jax.typeof(v).dtype) for v in leaves))


_BUG = "this is a herring_jax bug: please report it"


class _Split:
    """Receives allreduce.bind's reductions while split_reductions traces."""

    def __init__(self):
        self.tokens = []
        self.signatures = []
        self.finishing = False
        self.taken = 0

    def bind(self, leaves, params):
        signature = _signature(leaves, params)
        if not self.finishing:
            self.tokens.append(allreduce.allreduce_start_p.bind(*leaves, **params))
            self.signatures.append(signature)
            return _placeholders(leaves, params)
        if self.taken >= len(self.tokens) or self.signatures[self.taken] != signature:
            raise AssertionError("split_reductions: the second pass bound another reduction "
                                 f"than the first; {_BUG}")
        own = self.tokens[self.taken]
        others = self.tokens[:self.taken] + self.tokens[self.taken + 1:]
        self.taken += 1
        return allreduce.allreduce_p.bind(own, *others, *leaves, tokens=len(self.tokens),
                                          **params)


def _placeholders(leaves, params) -> list:
    """The first pass's results, which nothing uses, with the types of the
    reduction's results (so that the caller's code after it traces); with
    error feedback, the losses' after them (the operands' types)."""
    losses = list(leaves) if params["feedback"] else []
    if params["collective"] == "reduce_scatter":
        return [x[0] for x in leaves] + losses
    if params["collective"] in allreduce.GATHERS:
        n = allreduce.group_count(params["axes"], params["groups"])
        return [jax.numpy.broadcast_to(x[None], (n, *x.shape)) for x in leaves]
    return list(leaves) + losses


def split_reductions(reduce, buffers) -> list:
    """``[reduce(b) for b in buffers]``, every reduction's start (XLA:CUDA)
    ordered before any of their dones.

    Only where the buffers are traced by one jit (the training step); elsewhere
    (eagerly, under other transformations' own tracers) each reduction is
    bound on its own, as without the split.

    Examples:
      >>> outs = split_reductions(lambda b: herring_jax.allreduce(b), buffers)  # doctest: +SKIP
    """
    if not buffers or jax_compat.production_order(list(buffers)) is None:
        return [reduce(b) for b in buffers]
    split = _Split()
    with allreduce.binds_received_by(split):
        for b in buffers:
            reduce(b)
        split.finishing = True
        outs = [reduce(b) for b in buffers]
    if split.taken != len(split.tokens):
        raise AssertionError("split_reductions: the second pass bound fewer reductions "
                             f"than the first; {_BUG}")
    # What uses the results (the optimizer's update) comes after every
    # reduction: lowering.join_cpu says why XLA:CPU needs it.
    leaves, tree = jax.tree_util.tree_flatten(outs)
    return jax.tree_util.tree_unflatten(tree, join_p.bind(*leaves)) if leaves else outs


# join_p: the identity on any number of arrays, after which a step's reduced
# buckets are used. XLA:CPU lowers it to one call whose results alias its
# operands (lowering.join_cpu); XLA:CUDA, whose dones already follow every
# start, to nothing.
join_p = jex_core.Primitive("herring_join")
join_p.multiple_results = True
join_p.def_abstract_eval(lambda *avals: list(avals))
join_p.def_impl(lambda *xs: list(xs))
mlir.register_lowering(join_p, lowering.join_cpu, platform="cpu")
mlir.register_lowering(join_p, lambda ctx, *xs: list(xs), platform="cuda")
ad.primitive_jvps[join_p] = lambda primals, tangents: (join_p.bind(*primals), list(tangents))
batching.primitive_batchers[join_p] = lambda args, dims: (join_p.bind(*args), list(dims))
