"""Peer `torch_gloo`: torch.distributed's gloo all_reduce, reduce_scatter and
all_gather, PyTorch DDP's (and FSDP's) CPU backend."""

from __future__ import annotations

import os
import socket

import numpy as np

from herring_jax._src.tools.bench.peers.base import KV_PREFIX, KV_TIMEOUT_MS, Peer


class TorchGlooPeer(Peer):
    label = "torch.distributed.all_reduce, gloo backend (PyTorch DDP on CPU)"
    labels = {"reduce_scatter": "torch.distributed.reduce_scatter_single, gloo backend",
              "all_gather": "torch.distributed.all_gather_single, gloo backend"}
    needs = ("torch",)
    install = "pip install torch==2.13.0"

    def __init__(self, rank: int, n: int):
        import datetime as dt
        import torch.distributed as dist
        from herring_jax._src.process import jax_compat
        super().__init__(rank, n)
        # The rendezvous: a port free on rank 0's host, passed on through
        # jax.distributed's key-value store; the host is the coordinator's.
        client = jax_compat.distributed_client()
        if rank == 0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("0.0.0.0", 0))
                client.key_value_set(f"{KV_PREFIX}/torch_port", str(sock.getsockname()[1]))
        port = client.blocking_key_value_get(f"{KV_PREFIX}/torch_port", KV_TIMEOUT_MS)
        host = os.environ.get("HERRING_COORDINATOR_ADDRESS", "127.0.0.1:0").rsplit(":", 1)[0]
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=n, timeout=dt.timedelta(seconds=600))
        self._dist, self._n = dist, n

    def prepare(self, local: np.ndarray) -> None:
        import torch
        self._local = local
        self._tensor = torch.from_numpy(local.copy())
        size = {"reduce_scatter": local.size // self._n,
                "all_gather": local.size * self._n}.get(self.collective)
        self._out = None if size is None else torch.empty(size, dtype=self._tensor.dtype)

    def reset(self) -> None:
        # all_reduce works in place: each timed run starts from this rank's data.
        np.copyto(self._tensor.numpy(), self._local)

    def run(self):
        if self.collective == "reduce_scatter":
            self._dist.reduce_scatter_single(self._out, self._tensor)
            return self._out
        if self.collective == "all_gather":
            self._dist.all_gather_single(self._out, self._tensor)
            return self._out
        self._dist.all_reduce(self._tensor)
        return self._tensor

    @staticmethod
    def result(out) -> np.ndarray:
        return out.numpy()
