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

from herring_jax._src import fabric_env as _fabric_env

_fabric_env.prepare()  # before anything starts a thread; see fabric_env.py

# The public names, loaded on first use (PEP 562): `herring-jax launch` and
# the other commands import this package to reach herring_jax._src, and
# importing jax for them would cost every launch about a second.
_EXPORTS = {
    "HerringError": "errors",
    "herring_errors": "errors",
    "initialize": "runtime",
    "shutdown": "runtime",
    "describe": "runtime",
    "stats": "runtime",
    "process_count": "runtime",
    "process_index": "runtime",
    "allreduce": "allreduce",
    "broadcast": "broadcast",
    "reduce_scatter": "reduce_scatter",
    "allgather": "reduce_scatter",
    "barrier": "reduce_scatter",
    "pmean": "psum",
    "psum": "psum",
    "pmax": "psum",
    "pmin": "psum",
    "psum_scatter": "psum_scatter",
    "all_gather": "psum_scatter",
    "AllReduceGradientsState": "optax_transform",
    "CompressedGradientsState": "optax_transform",
    "allreduce_gradients": "optax_transform",
    "ShardedOptimizerState": "sharded",
    "sharded_optimizer": "sharded",
    "FullySharded": "fully_sharded",
    "FullyShardedGrads": "fully_sharded",
    "FullyShardedState": "fully_sharded",
    "fully_sharded": "fully_sharded",
    "restore_sharded": "sharded_checkpoint",
    "save_sharded": "sharded_checkpoint",
    "catch_preemption": "preemption",
    "preemption_requested": "preemption",
    "PREEMPTED_EXIT_CODE": "preemption",
    "PowerSGDState": "powersgd",
    "powersgd": "powersgd",
    "TopKState": "topk",
    "topk": "topk",
    "AccordionState": "accordion",
    "accordion": "accordion",
    "LocalSGDState": "local_sgd",
    "local_sgd": "local_sgd",
    "slowmo": "local_sgd",
    "diloco": "local_sgd",
    "local_sgd_in_flight": "streaming",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what static analysis and IDEs see
    from herring_jax._src.accordion import AccordionState, accordion
    from herring_jax._src.allreduce import allreduce
    from herring_jax._src.broadcast import broadcast
    from herring_jax._src.errors import HerringError, herring_errors
    from herring_jax._src.local_sgd import LocalSGDState, diloco, local_sgd, slowmo
    from herring_jax._src.optax_transform import (AllReduceGradientsState,
                                                  CompressedGradientsState, allreduce_gradients)
    from herring_jax._src.powersgd import PowerSGDState, powersgd
    from herring_jax._src.preemption import (PREEMPTED_EXIT_CODE, catch_preemption,
                                             preemption_requested)
    from herring_jax._src.psum import pmax, pmean, pmin, psum
    from herring_jax._src.psum_scatter import all_gather, psum_scatter
    from herring_jax._src.reduce_scatter import allgather, barrier, reduce_scatter
    from herring_jax._src.runtime import (describe, initialize, process_count, process_index,
                                          shutdown, stats)
    from herring_jax._src.fully_sharded import (FullySharded, FullyShardedGrads,
                                                FullyShardedState, fully_sharded)
    from herring_jax._src.sharded import ShardedOptimizerState, sharded_optimizer
    from herring_jax._src.sharded_checkpoint import restore_sharded, save_sharded
    from herring_jax._src.streaming import local_sgd_in_flight
    from herring_jax._src.topk import TopKState, topk


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
