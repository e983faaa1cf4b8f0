"""Peer `jax_psum`: jax.lax.psum, psum_scatter and all_gather over processes,
JAX's own gloo CPU collectives."""

from __future__ import annotations

import numpy as np

from herring_jax._src.tools.bench.peers.base import Peer

_IN_SHARD_MAP = "in jitted shard_map, one device per process (gloo)"


class JaxPsumPeer(Peer):
    label = f"jax.lax.psum {_IN_SHARD_MAP}"
    labels = {"reduce_scatter": f"jax.lax.psum_scatter(tiled=True) {_IN_SHARD_MAP}",
              "all_gather": f"jax.lax.all_gather(tiled=True) {_IN_SHARD_MAP}"}

    @staticmethod
    def configure() -> None:
        import jax
        # Without it jax has no cross-process CPU collectives; gloo is also
        # jax 0.10's default, set here so the peer is what the table says.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")

    def __init__(self, rank: int, n: int):
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        super().__init__(rank, n)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if len(devices) != n:
            raise SystemExit(f"jax_psum wants one device per process, found {len(devices)} "
                             f"devices for {n} processes")
        self._mesh = Mesh(np.array(devices), ("p",))
        # jax.sharding.Mesh axes are not Explicit, so shard_map takes the
        # NamedSharding input as is.
        self._sharding = NamedSharding(self._mesh, P("p"))

    def build(self, collective: str):
        import jax
        from jax.sharding import PartitionSpec as P
        body = {"allreduce": lambda v: jax.lax.psum(v, "p"),
                "reduce_scatter": lambda v: jax.lax.psum_scatter(v, "p", tiled=True),
                "all_gather": lambda v: jax.lax.all_gather(v, "p", tiled=True)}[collective]
        # Every output is per process (P("p")): a process's shard is its result.
        return jax.jit(jax.shard_map(body, mesh=self._mesh, in_specs=P("p"), out_specs=P("p")))

    def prepare(self, local: np.ndarray) -> None:
        import jax
        # Global shape (n * count,): shard i is process i's input.
        self._arg = jax.make_array_from_process_local_data(self._sharding, local)

    @staticmethod
    def result(out) -> np.ndarray:
        return np.asarray(out.addressable_shards[0].data)
