"""allreduce_gradients: the optax gradient transformation that averages (or
sums) gradients across processes or a mesh axis through herring_jax."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import optax

from herring_jax._src import fusion
from herring_jax._src import jax_compat
from herring_jax._src.allreduce import allreduce
from herring_jax._src.split import split_reductions
from herring_jax._src.psum import pmean, psum

DEFAULT_FIRST_BUCKET_BYTES = 2**20
# With fusion_bytes=None, buffers of about a sixteenth of the gradients of a
# dtype, kept between 1 MiB and 25 MiB (PyTorch DDP's bucket size): a small
# model gets enough buffers for its reductions to overlap the backward pass
# (2 simulated hosts, 8 MiB MLP: hidden fraction 0.53 with 1 MiB buffers, 0.32
# with 2 MiB, below 0 with one 25 MiB buffer), a large one no more calls than
# needed.
AUTO_BUCKETS = 16
MIN_FUSION_BYTES = 2**20
MAX_FUSION_BYTES = 25 * 2**20


def auto_fusion_bytes(leaves) -> int:
    """fusion_bytes for fusion_bytes=None: see AUTO_BUCKETS."""
    per_dtype: dict = {}
    for x in leaves:
        nbytes = int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
        per_dtype[np.dtype(x.dtype)] = per_dtype.get(np.dtype(x.dtype), 0) + nbytes
    largest = max(per_dtype.values(), default=0)
    return int(min(MAX_FUSION_BYTES, max(MIN_FUSION_BYTES, largest // AUTO_BUCKETS)))


class AllReduceGradientsState(NamedTuple):
    """allreduce_gradients keeps no state."""


def allreduce_gradients(axis_name=None, *, average: bool = True,
                        fusion_bytes: int | None = None,
                        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES
                        ) -> optax.GradientTransformation:
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
        mean here no longer divides that sum.
      average: mean (True) or sum (False) of the gradients.
      fusion_bytes: the most bytes in one fusion buffer. None (default): about a
        sixteenth of the gradients of each dtype, between 1 MiB and 25 MiB, so
        that small models get enough buffers to overlap.
      first_bucket_bytes: the most bytes in the first buffer of each dtype
        (default 1 MiB), so that the first reduction starts early.

    Returns:
      An ``optax.GradientTransformation``.

    Examples:
      >>> tx = optax.chain(herring_jax.allreduce_gradients(), optax.adamw(1e-3))
      >>> opt_state = tx.init(params)                                 # doctest: +SKIP
      >>> updates, opt_state = tx.update(grads, opt_state, params)    # doctest: +SKIP
    """
    if (fusion_bytes is not None and fusion_bytes <= 0) or first_bucket_bytes <= 0:
        raise ValueError("fusion_bytes and first_bucket_bytes must be positive, got "
                         f"{fusion_bytes} and {first_bucket_bytes}")
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
        size = auto_fusion_bytes(leaves) if fusion_bytes is None else fusion_bytes
        buckets = fusion.plan(leaves, size, first_bucket_bytes,
                              ready=jax_compat.production_order(leaves))
        # On XLA:CUDA every bucket's start comes before any bucket's done (the
        # host wait), so the whole backward pass is enqueued first; on XLA:CPU
        # this is one asynchronous call per bucket, as without the split.
        reduced = split_reductions(reduce, fusion.pack(leaves, buckets))
        return jax.tree_util.tree_unflatten(treedef, fusion.unpack(reduced, buckets, leaves)), state

    return optax.GradientTransformation(init_fn, update_fn)
