"""Peer `jax_psum`: jax.lax.psum over processes, JAX's own gloo CPU collectives."""

from __future__ import annotations

import numpy as np

from herring_jax._src.bench.peers.base import Peer


class JaxPsumPeer(Peer):
    label = "jax.lax.psum in jitted shard_map, one device per process (gloo)"

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
        mesh = Mesh(np.array(devices), ("p",))
        # jax.sharding.Mesh axes are not Explicit, so shard_map takes the
        # NamedSharding input as is.
        self._sharding = NamedSharding(mesh, P("p"))
        self._fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "p"), mesh=mesh,
                                         in_specs=P("p"), out_specs=P("p")))

    def prepare(self, local: np.ndarray) -> None:
        import jax
        # Global shape (n * count,): shard i is process i's buffer.
        self._arg = jax.make_array_from_process_local_data(self._sharding, local)

    @staticmethod
    def result(out) -> np.ndarray:
        return np.asarray(out.addressable_shards[0].data)
