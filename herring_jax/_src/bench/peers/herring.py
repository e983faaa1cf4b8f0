"""Peers `herring` and `herring_<codec>`: herring_jax.allreduce under jax.jit,
the code under test, uncompressed and with each wire codec."""

from __future__ import annotations

import numpy as np

from herring_jax._src import codecs
from herring_jax._src.bench.peers.base import Peer


class HerringPeer(Peer):
    label = "herring_jax.allreduce under jax.jit, process-local buffer"
    codec = "none"

    def __init__(self, rank: int, n: int):
        import jax
        import herring_jax
        super().__init__(rank, n)
        codec = self.codec
        self._fn = jax.jit(lambda v: herring_jax.allreduce(v, codec=codec))

    def prepare(self, local: np.ndarray) -> None:
        import jax.numpy as jnp
        self._arg = jnp.asarray(local)

    @classmethod
    def expected(cls, inputs: list[np.ndarray], hosts: list[list[int]],
                 exact: np.ndarray) -> np.ndarray:
        """The result every rank must hold: `inputs` by rank, `hosts` the ranks
        of each host, `exact` the uncompressed sum. A codec encodes what
        crosses the network: each host's sum (summed exactly in memory), or
        nothing where one host holds every process."""
        if cls.codec == "none" or len(hosts) < 2:
            return exact
        stage = [np.sum([inputs[r] for r in h], axis=0, dtype=np.float32) for h in hosts]
        return codecs.reduce_np(cls.codec, "sum", stage, len(inputs))


def codec_peer(codec: str) -> type[HerringPeer]:
    """The peer `herring_<codec>`."""
    share = codecs.wire_bytes(codec, 1 << 20) / (4 << 20)
    return type(f"Herring_{codec}", (HerringPeer,), {
        "codec": codec,
        "label": f"herring_jax.allreduce(codec={codec!r}) under jax.jit: {share:.2f}x the bytes"})
