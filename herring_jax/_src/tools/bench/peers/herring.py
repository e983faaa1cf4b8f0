"""Peers `herring` and `herring_<codec>`: herring_jax's collectives under
jax.jit, the code under test, uncompressed and with each wire codec."""

from __future__ import annotations

import numpy as np

from herring_jax._src.collectives import codecs
from herring_jax._src.tools.bench import collectives as coll
from herring_jax._src.tools.bench.peers.base import Peer


class HerringPeer(Peer):
    label = "herring_jax.allreduce under jax.jit, process-local buffer"
    labels = {"reduce_scatter": "herring_jax.reduce_scatter under jax.jit",
              "all_gather": "herring_jax.allgather under jax.jit"}
    codec = "none"

    def build(self, collective: str):
        import jax
        import herring_jax
        codec = self.codec
        if collective == "allreduce":
            return jax.jit(lambda v: herring_jax.allreduce(v, codec=codec))
        if collective == "reduce_scatter":
            return jax.jit(lambda v: herring_jax.reduce_scatter(v, codec=codec))
        # allgather gives (n, B): the bench compares the whole buffer, flat.
        return jax.jit(lambda v: herring_jax.allgather(v, codec=codec).reshape(-1))

    def prepare(self, local: np.ndarray) -> None:
        import jax.numpy as jnp
        self._arg = jnp.asarray(local)

    @classmethod
    def expected(cls, collective: str, count: int, rank: int, n: int,
                 hosts: list[list[int]]) -> np.ndarray:
        """What process `rank` must hold after `collective` on `count`
        elements (collectives.py), `hosts` the ranks of each host. A codec
        encodes what crosses the network: each host's sum (summed exactly in
        memory) and the sums sent back, or, in an all-gather, every part (its
        owner's too, so that every process holds the same bits); nothing
        where one host holds every process. A reduce-scatter's part is
        bitwise that part of the all-reduce."""
        exact = coll.expected(collective, count, rank, n)
        if cls.codec == "none" or len(hosts) < 2:
            return exact
        if collective == "all_gather":
            return codecs.roundtrip_np(cls.codec, exact)
        inputs = [coll.pattern(count, r) for r in range(n)]
        stage = [np.sum([inputs[r] for r in h], axis=0, dtype=np.float32) for h in hosts]
        return coll.part_of(collective, codecs.reduce_np(cls.codec, "sum", stage, n), rank, n)


def codec_peer(codec: str) -> type[HerringPeer]:
    """The peer `herring_<codec>`."""
    share = codecs.wire_bytes(codec, 1 << 20) / (4 << 20)
    what = f"under jax.jit: {share:.2f}x the bytes"
    return type(f"Herring_{codec}", (HerringPeer,), {
        "codec": codec,
        "label": f"herring_jax.allreduce(codec={codec!r}) {what}",
        "labels": {c: f"herring {c.replace('_', '-')}, codec {codec!r}, {what}"
                   for c in ("reduce_scatter", "all_gather")}})
