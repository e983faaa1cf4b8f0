"""herring_jax: Herring's sharded parameter-server gradient reduction for JAX.

A process-local all-reduce that runs as an XLA FFI custom call over libfabric:
every process hosts a server shard, each buffer is cut into equal parts (one
per server), servers sum their part in rank order and send it back.

Examples:
  >>> import jax.numpy as jnp, herring_jax
  >>> herring_jax.initialize()                     # doctest: +SKIP
  >>> herring_jax.allreduce(jnp.ones(4), op="mean")  # doctest: +SKIP
"""

import importlib
from typing import TYPE_CHECKING

from herring_jax._src.process import fabric_env as _fabric_env

_fabric_env.prepare()  # before anything starts a thread; see fabric_env.py

# The public names, loaded on first use (PEP 562): `herring-jax launch` and
# the other commands import this package to reach herring_jax._src, and
# importing jax for them would cost every launch about a second.
_EXPORTS = {
    "HerringError": "process.errors",
    "herring_errors": "process.errors",
    "initialize": "process.runtime",
    "shutdown": "process.runtime",
    "describe": "process.runtime",
    "stats": "process.runtime",
    "process_count": "process.runtime",
    "process_index": "process.runtime",
    "allreduce": "collectives.allreduce",
    "broadcast": "collectives.broadcast",
    "reduce_scatter": "collectives.reduce_scatter",
    "allgather": "collectives.reduce_scatter",
    "barrier": "collectives.reduce_scatter",
    "pmean": "collectives.psum",
    "psum": "collectives.psum",
    "pmax": "collectives.psum",
    "pmin": "collectives.psum",
    "psum_scatter": "collectives.psum_scatter",
    "all_gather": "collectives.psum_scatter",
    "AllReduceGradientsState": "transforms.optax_transform",
    "CompressedGradientsState": "transforms.optax_transform",
    "allreduce_gradients": "transforms.optax_transform",
    "ShardedOptimizerState": "transforms.sharded",
    "sharded_optimizer": "transforms.sharded",
    "FullySharded": "transforms.fully_sharded",
    "FullyShardedGrads": "transforms.fully_sharded",
    "FullyShardedState": "transforms.fully_sharded",
    "fully_sharded": "transforms.fully_sharded",
    "restore_sharded": "checkpoints.sharded_checkpoint",
    "save_sharded": "checkpoints.sharded_checkpoint",
    "catch_preemption": "checkpoints.preemption",
    "preemption_requested": "checkpoints.preemption",
    "PREEMPTED_EXIT_CODE": "process.exit_status",
    "PowerSGDState": "transforms.powersgd",
    "powersgd": "transforms.powersgd",
    "TopKState": "transforms.topk",
    "topk": "transforms.topk",
    "AccordionState": "transforms.accordion",
    "accordion": "transforms.accordion",
    "LocalSGDState": "transforms.local_sgd",
    "local_sgd": "transforms.local_sgd",
    "slowmo": "transforms.local_sgd",
    "diloco": "transforms.local_sgd",
    "local_sgd_in_flight": "transforms.streaming",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what static analysis and IDEs see
    from herring_jax._src.transforms.accordion import AccordionState, accordion
    from herring_jax._src.collectives.allreduce import allreduce
    from herring_jax._src.collectives.broadcast import broadcast
    from herring_jax._src.process.errors import HerringError, herring_errors
    from herring_jax._src.transforms.local_sgd import LocalSGDState, diloco, local_sgd, slowmo
    from herring_jax._src.transforms.optax_transform import (AllReduceGradientsState,
                                                             CompressedGradientsState,
                                                             allreduce_gradients)
    from herring_jax._src.transforms.powersgd import PowerSGDState, powersgd
    from herring_jax._src.checkpoints.preemption import catch_preemption, preemption_requested
    from herring_jax._src.process.exit_status import PREEMPTED_EXIT_CODE
    from herring_jax._src.collectives.psum import pmax, pmean, pmin, psum
    from herring_jax._src.collectives.psum_scatter import all_gather, psum_scatter
    from herring_jax._src.collectives.reduce_scatter import allgather, barrier, reduce_scatter
    from herring_jax._src.process.runtime import (describe, initialize, process_count,
                                                  process_index, shutdown, stats)
    from herring_jax._src.transforms.fully_sharded import (FullySharded, FullyShardedGrads,
                                                           FullyShardedState, fully_sharded)
    from herring_jax._src.transforms.sharded import ShardedOptimizerState, sharded_optimizer
    from herring_jax._src.checkpoints.sharded_checkpoint import restore_sharded, save_sharded
    from herring_jax._src.transforms.streaming import local_sgd_in_flight
    from herring_jax._src.transforms.topk import TopKState, topk


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'herring_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"herring_jax._src.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


__version__ = "0.1.0"
