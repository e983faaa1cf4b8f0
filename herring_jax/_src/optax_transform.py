"""allreduce_gradients: the optax gradient transformation that averages (or
sums) gradients across processes or a mesh axis through herring_jax."""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax

from herring_jax._src import fusion
from herring_jax._src.allreduce import allreduce
from herring_jax._src.psum import pmean, psum

DEFAULT_FUSION_BYTES = 25 * 2**20


class AllReduceGradientsState(NamedTuple):
    """allreduce_gradients keeps no state."""


def allreduce_gradients(axis_name=None, *, average: bool = True,
                        fusion_bytes: int = DEFAULT_FUSION_BYTES
                        ) -> optax.GradientTransformation:
    """Reduces gradients across data-parallel workers with Herring.

    Put it first in an ``optax.chain``. Gradients are packed into fusion
    buffers of at most ``fusion_bytes`` per dtype, last parameters first, one
    reduction (one custom call) per buffer, then unpacked.

    Args:
      axis_name: None reduces process-local gradients across processes (one
        process per accelerator, Horovod style). A mesh axis name (or tuple)
        reduces over that axis inside ``jax.shard_map`` / ``pmap``. Inside
        shard_map, use ``check_vma=False`` (pmap semantics) so that gradients
        of replicated parameters stay per-device: with varying-axis checks on,
        jax already sums them over the mesh in the backward pass, and the
        mean here no longer divides that sum.
      average: mean (True) or sum (False) of the gradients.
      fusion_bytes: the most bytes in one fusion buffer (default 25 MiB).

    Returns:
      An ``optax.GradientTransformation``.

    Examples:
      >>> tx = optax.chain(herring_jax.allreduce_gradients(), optax.adamw(1e-3))
      >>> opt_state = tx.init(params)                                 # doctest: +SKIP
      >>> updates, opt_state = tx.update(grads, opt_state, params)    # doctest: +SKIP
    """
    if fusion_bytes <= 0:
        raise ValueError(f"fusion_bytes must be positive, got {fusion_bytes}")
    op = "mean" if average else "sum"

    def reduce(buffer):
        if axis_name is None:
            return allreduce(buffer, op=op)
        return (pmean if average else psum)(buffer, axis_name)

    def init_fn(params):
        del params
        return AllReduceGradientsState()

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        buckets = fusion.plan(leaves, fusion_bytes)
        reduced = [reduce(b) for b in fusion.pack(leaves, buckets)]
        return jax.tree_util.tree_unflatten(treedef, fusion.unpack(reduced, buckets, leaves)), state

    return optax.GradientTransformation(init_fn, update_fn)
