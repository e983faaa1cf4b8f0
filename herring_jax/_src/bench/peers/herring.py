"""Peers `herring` and `herring_<codec>`: herring_jax's collectives under
jax.jit, the code under test, uncompressed and with each wire codec."""

from __future__ import annotations

import numpy as np

from herring_jax._src import codecs
from herring_jax._src.bench import collectives as coll
from herring_jax._src.bench.peers.base import Peer


def _process_collective(x, collective: str, codec: str):
    """A reduce-scatter (sum) or all-gather of the process-local 1-D x.

    A stand-in for herring_jax.reduce_scatter and herring_jax.allgather
    until they exist: the bench needs the engine's collectives now, and this
    is the one place that calls the custom call directly. Replace it by the
    public functions when they land (herring_jax.allgather returns (n, B):
    flatten it, as this returns n*B).
    """
    import jax
    from herring_jax._src import lowering, runtime

    st = runtime.state()
    n = st.size
    out_count = -(-x.size // n) if collective == "reduce_scatter" else n * x.size

    def i64(v):
        return np.asarray(v, np.int64)

    # What lowering._attributes gives a call of one device per process.
    attrs = dict(
        comm=np.int64(st.handle),
        op=np.int64(lowering.OPS["sum"] | lowering.CODECS[codec] << 24),
        key=np.int64(lowering.key("sum", [jax.typeof(x)], codec, collective)),
        slot=np.int64(0), device_procs=i64([-1]), device_locals=i64([-1]),
        device_groups=i64([0]), group_streams=i64([0]), group_ranks=i64(range(n)),
        group_offsets=i64([0, n]), collective=np.int64(lowering.COLLECTIVES[collective]),
        device_blocks=i64([-1]))
    return jax.ffi.ffi_call("herring_allreduce", jax.ShapeDtypeStruct((out_count,), x.dtype),
                            has_side_effect=True)(x, **attrs)


class HerringPeer(Peer):
    label = "herring_jax.allreduce under jax.jit, process-local buffer"
    labels = {"reduce_scatter": "herring reduce-scatter (the engine's custom call) under jax.jit",
              "all_gather": "herring all-gather (the engine's custom call) under jax.jit"}
    codec = "none"

    def build(self, collective: str):
        import jax
        import herring_jax
        codec = self.codec
        if collective == "allreduce":
            return jax.jit(lambda v: herring_jax.allreduce(v, codec=codec))
        return jax.jit(lambda v: _process_collective(v, collective, codec))

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
