"""Error feedback is exactly what the reduction lost, whatever the topology:
allreduce_gradients or sharded_optimizer with a lossy codec, checked every
step on every rank against a numpy model of what the engine encodes where.

The model (docs/guides/compression.md, "what is encoded where"): each process
sends its gradient plus its residual. On one host the host stage sums them
through memory in float32 and nothing is encoded: the residual stays zero and
the result is the exact mean. Across hosts with one process each, every
process encodes its own contribution and keeps what that lost. Across hosts
with several processes each, the processes with local index j encode slice j
of their host's float32 sum (an all-reduce's j-th equal slice; a
reduce-scatter's parts of the ranks with local index j), and each keeps what
its slices lost, nowhere else; so every loss is kept once.

Usage (under the launcher; HERRING_TEST_HOSTS gives the simulated hosts):
  python tests/workers/ef_host_worker.py --codec int8 --transform allreduce
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src import codecs  # noqa: E402

# One float32 leaf (one fusion buffer) of whole codec blocks per worker, so
# that sharded_optimizer's buffer is the leaf itself, in order.
SIZE = 4096


def encoded_ranges(transform: str, rank: int, hosts: list[list[int]]) -> list[tuple[int, int]]:
    """The elements of the buffer whose host sum `rank` encodes (hierarchical)."""
    per_host = len(hosts[0])
    j = next(h.index(rank) for h in hosts if rank in h)
    if transform == "allreduce":
        # host_stage.cc's SliceElems: equal slices, at codec blocks.
        s = -(-(-(-SIZE // per_host)) // codecs.BLOCK) * codecs.BLOCK
        return [(min(SIZE, j * s), min(SIZE, (j + 1) * s))]
    c = SIZE // sum(len(h) for h in hosts)  # each worker's part (chunk)
    return [(h[j] * c, (h[j] + 1) * c) for h in hosts]


def lost(codec: str, x: np.ndarray) -> np.ndarray:
    d = x - codecs.roundtrip_np(codec, x)
    return np.where(np.isfinite(d), d, np.float32(0)).astype(np.float32)


def model(codec, transform, sent, hosts):
    """(result, residual of every rank) of one step."""
    nproc = len(sent)
    result = common.reference("float32", "mean", [[s] for s in sent], hosts, codec)
    residual = [np.zeros(SIZE, np.float32) for _ in range(nproc)]
    per_host = len(hosts[0])
    if not common.host_stage_on() or per_host == 1:
        return result, [lost(codec, s) for s in sent]  # flat: each its own
    if len(hosts) == 1:
        return result, residual  # one host: nothing encoded
    for h in hosts:
        host_lost = lost(codec, common._sum_in_order([sent[r] for r in h], np.float32))
        for r in h:
            for a, b in encoded_ranges(transform, r, hosts):
                residual[r][a:b] = host_lost[a:b]
    return result, residual


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--transform", choices=("allreduce", "sharded"), default="allreduce")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    hosts = common.hosts_from_env(nproc)

    if args.transform == "allreduce":
        tx = herring_jax.allreduce_gradients(compression=args.codec)
    else:
        tx = herring_jax.sharded_optimizer(optax.identity(), compression=args.codec)
    params = {"w": jnp.zeros(SIZE, jnp.float32)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    residuals = [np.zeros(SIZE, np.float32) for _ in range(nproc)]
    ok = True
    kept_any = False
    for step in range(args.steps):
        g = [common.make_input("float32", SIZE, r, step) for r in range(nproc)]
        out, state = update({"w": jnp.asarray(g[rank])}, state, params)
        want, residuals = model(args.codec, args.transform,
                                [g[r] + residuals[r] for r in range(nproc)], hosts)
        got_w = np.asarray(out["w"])
        got_e = np.asarray(state.residual["w"])
        out_ok = common.bitwise_equal(got_w, want)
        residual_ok = common.bitwise_equal(got_e, residuals[rank])
        kept_any = kept_any or any(np.any(e != 0) for e in residuals)
        ok = ok and out_ok and residual_ok
        common.report(f"step{step}", out_ok and residual_ok, digest=common.digest(got_w),
                      out_ok=out_ok, residual_ok=residual_ok,
                      residual_norm=float(np.linalg.norm(got_e)))
    # Where something crosses hosts, the model's residuals must have fed back
    # (else the steps above would not tell feedback from none).
    crosses = len(hosts) > 1 or not common.host_stage_on()
    common.report("ef", ok and kept_any == crosses, kept_any=kept_any)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
