"""herring_jax.reduce_scatter and allgather with server-only processes
(herring-jax launch --servers K): each block (one process's part) goes partly
through the servers. Every case is checked bitwise against numpy in herring's
documented order (common.reference, with the codec's model where one is
named), and reports its digest (which the test compares with the same job
without servers) and how many buffers placed parts on the servers.

Usage (under the launcher): python tests/workers/served_halves_worker.py
  [--codecs bf16,fp16,int8] [--counts 7,4097,70001]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.collectives import codecs  # noqa: E402


def part(flat_sum: np.ndarray, rank: int, nproc: int) -> np.ndarray:
    """reduce_scatter's documented cut: B = ceil(size / N) elements from
    rank * B, zero-padded."""
    b = -(-flat_sum.size // nproc)
    padded = np.concatenate([flat_sum, np.zeros(b * nproc - flat_sum.size, flat_sum.dtype)])
    return padded[rank * b:(rank + 1) * b]


def served_jobs() -> int:
    return herring_jax.stats()["served_jobs"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--codecs", default="none")
    parser.add_argument("--counts", default="7,4097,70001")
    args = parser.parse_args()
    herring_jax.initialize()
    me, nproc = jax.process_index(), jax.process_count()
    hosts = common.hosts_from_env(nproc)
    counts = [int(c) for c in args.counts.split(",")]
    codec_names = args.codecs.split(",")
    plain = codec_names == ["none"]
    scatter = jax.jit(herring_jax.reduce_scatter, static_argnames=("op", "codec"))
    gather = jax.jit(herring_jax.allgather, static_argnames=("codec",))
    salt = 0
    for codec in codec_names:
        dtypes = ("float32", "bfloat16", "int32") if plain else ("float32",)
        for dtype in dtypes:
            for count in counts:
                salt += 1
                everyone = [common.make_input(dtype, count, r, salt) for r in range(nproc)]
                for op in ("sum", "mean") if dtype != "int32" else ("sum",):
                    before = served_jobs()
                    got = np.asarray(scatter(jnp.asarray(everyone[me]), op=op, codec=codec))
                    served = served_jobs() - before
                    total = common.reference(dtype, op, [[x] for x in everyone], hosts,
                                             codec=codec)
                    common.report(f"reduce_scatter/{codec}/{dtype}/{op}/{count}",
                                  common.bitwise_equal(got, part(total, me, nproc)),
                                  digest=common.digest(got), served=served)
                before = served_jobs()
                got = np.asarray(gather(jnp.asarray(everyone[me]), codec=codec))
                served = served_jobs() - before
                if codec == "none":
                    want = np.stack(everyone)
                else:
                    # What the codec carries, decoded: the same on every rank.
                    want = np.stack([codecs.roundtrip_np(codec, x)
                                     for x in everyone])
                common.report(f"allgather/{codec}/{dtype}/{count}",
                              common.bitwise_equal(got, want), digest=common.digest(got),
                              served=served)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
