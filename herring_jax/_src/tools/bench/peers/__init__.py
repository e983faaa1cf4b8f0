"""The peers of `herring-jax bench`, one module each; PEERS names them.

A peer is a Peer subclass (peers/base.py). Modules import only numpy at
import time: each peer imports its library when it is built, in the
worker, so the driver runs without any of them installed.
"""

from __future__ import annotations

import importlib.util as importlib_util
import shutil

from herring_jax._src.tools.bench.peers.base import Peer
from herring_jax._src.tools.bench.peers.herring import HerringPeer, codec_peer
from herring_jax._src.tools.bench.peers.jax_psum import JaxPsumPeer
from herring_jax._src.tools.bench.peers.mpi4jax import Mpi4jaxPeer
from herring_jax._src.tools.bench.peers.mpi4py import Mpi4pyPeer
from herring_jax._src.tools.bench.peers.torch_gloo import TorchGlooPeer

# In the order every worker runs them.
PEERS: dict[str, type[Peer]] = {
    "herring": HerringPeer, "jax_psum": JaxPsumPeer, "mpi4jax": Mpi4jaxPeer,
    "mpi4py": Mpi4pyPeer, "torch_gloo": TorchGlooPeer}
# herring with a wire codec (--codecs adds them after the others), e.g.
# herring_int8; timed against `herring` in the same run.
CODEC_PEERS: dict[str, type[Peer]] = {
    f"herring_{c}": codec_peer(c) for c in ("bf16", "fp16", "int8")}
PEERS.update(CODEC_PEERS)


def missing_peers(names: list[str]) -> dict[str, str]:
    """Peers among `names` that cannot run here, each with the reason and the fix."""
    missing = {}
    for name in names:
        peer = PEERS[name]
        absent = [m for m in peer.needs if importlib_util.find_spec(m) is None]
        if absent:
            missing[name] = f"{', '.join(absent)} not installed ({peer.install})"
        elif peer.mpi and shutil.which("mpirun") is None:
            missing[name] = f"mpirun not found ({peer.install})"
    return missing
