"""Error feedback is exactly what the reduction lost, whatever the topology:
allreduce_gradients, sharded_optimizer or fully_sharded with a lossy codec,
checked every step on every rank against a numpy model of what the engine
encodes where.

The model (docs/guides/compression.md, "what is encoded where"): each process
sends its gradient plus its residual. On one host the host stage sums them
through memory in float32 and nothing is encoded: the residual stays zero and
the result is the exact mean. Across hosts with one process each, every
process encodes its own contribution and keeps what that lost. Across hosts
with several processes each, the processes with local index j encode slice j
of their host's float32 sum (an all-reduce's j-th equal slice; a
reduce-scatter's parts of the ranks with local index j), and each keeps what
its slices lost, nowhere else; so every loss is kept once. With several
devices per process (--devices, allreduce_gradients('d') inside shard_map)
a process's contribution is its devices' sum, whose loss its first device
keeps.

Usage (under the launcher; HERRING_TEST_HOSTS gives the simulated hosts):
  python tests/workers/ef_host_worker.py --codec int8 --transform allreduce
"""

from __future__ import annotations

import argparse
import os
import types
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.collectives import codecs  # noqa: E402
from herring_jax._src.transforms.optax_transform import CompressedGradientsState  # noqa: E402

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
    """(result, residual of every rank's every device) of one step;
    sent[rank][device]."""
    result = common.reference("float32", "mean", sent, hosts, codec)
    procs = [common._sum_in_order(devs, np.float32) for devs in sent]
    kept = [np.zeros(SIZE, np.float32) for _ in sent]
    if not common.host_stage_on() or len(hosts[0]) == 1:
        kept = [lost(codec, p) for p in procs]  # flat: each its own
    elif len(hosts) > 1:  # (one host: nothing encoded)
        for h in hosts:
            host_lost = lost(codec, common._sum_in_order([procs[r] for r in h], np.float32))
            for r in h:
                for a, b in encoded_ranges(transform, r, hosts):
                    kept[r][a:b] = host_lost[a:b]
    residual = [[k] + [np.zeros(SIZE, np.float32) for _ in devs[1:]]
                for k, devs in zip(kept, sent)]
    return result, residual


def per_device_update(tx, devices: int):
    """tx.update inside shard_map over every device of the job (axis 'd'),
    each device with its own gradient and residual (leading axis: devices)."""
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    spec = NamedSharding(mesh, P("d"))

    def body(g, residual, params):
        out, state = tx.update({"w": g[0]}, CompressedGradientsState({"w": residual[0]}), params)
        return out["w"][None], state.residual["w"][None]

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d"), P()),
                                 out_specs=(P("d"), P("d")), check_vma=False))

    def update(local_grads, local_residuals, params):
        g = jax.make_array_from_process_local_data(spec, local_grads)
        e = jax.make_array_from_process_local_data(spec, local_residuals)
        out, res = step(g, e, params)
        shards = lambda a: np.stack([np.asarray(s.data[0]) for s in  # noqa: E731
                                     sorted(a.addressable_shards, key=lambda s: s.index)])
        return shards(out), shards(res)

    return update


def fully_sharded_as_update(codec: str, params):
    """fully_sharded(compression=codec) seen as tx.init / tx.update(g, state,
    params) -> (this rank's chunk of the reduced g, state whose .residual is
    the new residual): the loss sum(w * g) has the gradient g, whatever w."""
    fs = herring_jax.fully_sharded(optax.sgd(0.0), compression=codec, check_inner=False)

    def update(g, state, params):
        del params
        _, grads = fs.value_and_grad(lambda p, c: jnp.sum(p["w"] * c))(state, g["w"])
        return ({"w": grads.chunks["w"].reshape(-1)},
                fs.apply_gradients(state, grads))

    return types.SimpleNamespace(init=fs.init, update=update)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--transform", choices=("allreduce", "sharded", "fully"),
                        default="allreduce")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    hosts = common.hosts_from_env(nproc)
    devs = args.devices

    axis = "d" if devs > 1 else None
    params = {"w": jnp.zeros(SIZE, jnp.float32)}
    if args.transform == "allreduce":
        tx = herring_jax.allreduce_gradients(axis, compression=args.codec)
    elif args.transform == "sharded":
        tx = herring_jax.sharded_optimizer(optax.identity(), compression=args.codec)
    else:
        tx = fully_sharded_as_update(args.codec, params)
    state = tx.init(params)
    update = jax.jit(tx.update) if devs == 1 else per_device_update(tx, devs)
    residuals = [[np.zeros(SIZE, np.float32)] * devs for _ in range(nproc)]
    mine = np.zeros((devs, SIZE), np.float32)
    ok = True
    kept_any = False
    for step in range(args.steps):
        g = [[common.make_input("float32", SIZE, r * devs + d, step) for d in range(devs)]
             for r in range(nproc)]
        if devs == 1:
            out, state = update({"w": jnp.asarray(g[rank][0])}, state, params)
            got_w, got_e = np.asarray(out["w"]), np.asarray(state.residual["w"])
        else:
            # The residual this rank's devices kept at the last step.
            got, got_e = update(np.stack(g[rank]), mine, params)
            mine = got_e
            got_w = got[0]
            assert all(common.bitwise_equal(o, got_w) for o in got)
        want, residuals = model(args.codec, args.transform,
                                [[x + e for x, e in zip(g[r], residuals[r])]
                                 for r in range(nproc)], hosts)
        if args.transform == "fully":  # this rank's chunk of the mean
            c = SIZE // nproc
            want = want[rank * c:(rank + 1) * c]
        out_ok = common.bitwise_equal(got_w, want)
        residual_ok = common.bitwise_equal(got_e, np.stack(residuals[rank]).reshape(got_e.shape))
        kept_any = kept_any or any(np.any(e != 0) for devs_e in residuals for e in devs_e)
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
