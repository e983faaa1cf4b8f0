"""Weighted means (allreduce / pmean weight=, allreduce_gradients and
sharded_optimizer weight=True) checked bitwise against common.weighted_reference,
the numpy model of herring_jax/_src/collectives/weighted.py, in rank order.

Usage (under the launcher): python tests/workers/weighted_worker.py [--devices 2]
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
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

SHAPES = {"a": (5, 3), "b": (17,), "c": (4,)}  # "b" travels as bfloat16


def weight_of(contributor: int, salt: int) -> float:
    """Distinct weights that are not all equal (else the weighted mean would
    be the plain one): 0.75, 1.5, ... 3.75."""
    return 0.75 * (1 + (contributor * 3 + salt) % 5)


def check(case, got, want, **extra):
    """Every device's result bitwise the model's (the driver also compares
    the ranks' digests)."""
    ok = all(common.bitwise_equal(g, want) for g in got)
    if not ok:  # what to look at: the first values, dtypes and shapes of both
        g = np.asarray(got[0])
        extra["got_want"] = [str(g.reshape(-1)[:3]), str(want.reshape(-1)[:3]),
                             f"{g.dtype}{g.shape}", f"{want.dtype}{want.shape}"]
    common.report(case, ok, digest=common.digest(got[0]), **extra)


def grads(contributor: int, step: int) -> dict:
    tree = common.make_tree(SHAPES, contributor, step)
    tree["b"] = tree["b"].astype(common.NP_DTYPES["bfloat16"])
    return tree


def tree_reference(trees, weights, hosts, codec="none"):
    """weighted_reference per leaf; trees[process][device]."""
    return {k: common.weighted_reference(str(trees[0][0][k].dtype), [[t[k] for t in ts]
                                                                     for ts in trees],
                                         weights, hosts, codec=codec if k != "b" else "none")
            for k in SHAPES}


def one_device(rank: int, nproc: int, hosts) -> None:
    def inputs(dtype, count, salt):
        return [[common.make_input(dtype, count, p, salt)] for p in range(nproc)]

    salt = 0
    for dtype in ("float32", "bfloat16", "float16", "float64"):
        for count in (1, 7, 4097):
            salt += 1
            xs = inputs(dtype, count, salt)
            ws = [[weight_of(p, salt)] for p in range(nproc)]
            got = herring_jax.allreduce(xs[rank][0], op="mean", weight=ws[rank][0])
            want = common.weighted_reference(dtype, xs, ws, hosts)
            plain = common.reference(dtype, "mean", xs, hosts)
            check(f"eager/{dtype}/{count}", [np.asarray(got)], want,
                  differs_from_mean=not common.bitwise_equal(want, plain))

    # complex64: real and imaginary parts each times w.
    xs = [[(common.make_input("float32", 9, p, 50)
            + 1j * common.make_input("float32", 9, p, 51)).astype(np.complex64)]
          for p in range(nproc)]
    ws = [[weight_of(p, 50)] for p in range(nproc)]
    got = herring_jax.allreduce(xs[rank][0], op="mean", weight=ws[rank][0])
    check("eager/complex64/9", [np.asarray(got)], common.weighted_reference("complex64", xs, ws,
                                                                            hosts))

    # Inside jit, the weight traced.
    mean = jax.jit(lambda x, w: herring_jax.allreduce(x, op="mean", weight=w))
    xs, ws = inputs("float32", 4097, 60), [[weight_of(p, 60)] for p in range(nproc)]
    got = mean(xs[rank][0], jnp.float32(ws[rank][0]))
    check("jit/float32/4097", [np.asarray(got)], common.weighted_reference("float32", xs, ws,
                                                                           hosts))

    # A lossy codec on the data; the weight crosses exactly.
    xs, ws = inputs("float32", 4097, 61), [[weight_of(p, 61)] for p in range(nproc)]
    got = herring_jax.allreduce(xs[rank][0], op="mean", weight=ws[rank][0], codec="bf16")
    check("codec-bf16/float32/4097", [np.asarray(got)],
          common.weighted_reference("float32", xs, ws, hosts, codec="bf16"))

    # A process with weight 0 contributes zeros, even where its data is NaN.
    xs, ws = inputs("float32", 7, 62), [[weight_of(p, 62)] for p in range(nproc)]
    xs[0][0][:] = np.nan
    ws[0][0] = 0.0
    got = mean(xs[rank][0], jnp.float32(ws[rank][0]))
    want = common.weighted_reference("float32", xs, ws, hosts)
    check("zero-weight-ignores-nan", [np.asarray(got)], want,
          finite=bool(np.isfinite(np.asarray(got)).all()))

    # A total weight of 0: zeros, not NaN.
    got = mean(xs[rank][0], jnp.float32(0.0))
    common.report("zero-total-is-zeros", common.bitwise_equal(np.asarray(got),
                                                              np.zeros(7, np.float32)))

    # A negative weight on the last rank: NaN everywhere under jit; outside
    # jit a ValueError on every rank, after the reduction.
    bad = -1.0 if rank == nproc - 1 else 2.0
    got = np.asarray(mean(xs[1][0], jnp.float32(bad)))
    common.report("negative-weight-nan-in-jit", bool(np.isnan(got).all()))
    try:
        herring_jax.allreduce(xs[1][0], op="mean", weight=bad)
        common.report("negative-weight-raises-eagerly", False, message="no exception")
    except ValueError as e:
        common.report("negative-weight-raises-eagerly", "negative" in str(e), message=str(e)[:200])

    # allreduce_gradients(weight=True) in a jitted step, through optax.chain's
    # extra arguments, several buckets (the weight in the first float32 one),
    # three steps with other weights each.
    for compression in ("none", "bf16"):
        tx = optax.chain(herring_jax.allreduce_gradients(weight=True, fusion_bytes=32,
                                                         compression=compression),
                         optax.identity())
        step = jax.jit(lambda g, s, w, tx=tx: tx.update(g, s, None, weight=w))
        state = tx.init(grads(rank, 0))
        for t in range(3 if compression == "none" else 1):
            trees = [[grads(p, t)] for p in range(nproc)]
            ws = [[weight_of(p, t)] for p in range(nproc)]
            out, state = step(trees[rank][0], state, jnp.float32(ws[rank][0]))
            want = tree_reference(trees, ws, hosts, codec=compression)
            ok = all(common.bitwise_equal(np.asarray(out[k]), want[k]) for k in SHAPES)
            common.report(f"allreduce_gradients/{compression}/step{t}", ok,
                          digest=common.digest(np.asarray(out["a"])))

    # sharded_optimizer(weight=True): bitwise the weighted unsharded chain.
    sgd = optax.sgd(0.1)
    tree = {k: v for k, v in grads(rank, 0).items() if k != "b"}
    chain = optax.chain(herring_jax.allreduce_gradients(weight=True), sgd)
    sharded = herring_jax.sharded_optimizer(sgd, weight=True)
    params = jax.tree_util.tree_map(jnp.zeros_like, tree)
    results = []
    for tx in (chain, sharded):
        state, p = tx.init(params), params
        update = jax.jit(lambda g, s, p, w, tx=tx: tx.update(g, s, p, weight=w))
        for t in range(2):
            g = {k: v for k, v in grads(rank, t).items() if k != "b"}
            u, state = update(g, state, p, jnp.float32(weight_of(rank, t)))
            p = optax.apply_updates(p, u)
        results.append(p)
    same = all(common.bitwise_equal(np.asarray(results[0][k]), np.asarray(results[1][k]))
               for k in tree)
    common.report("sharded_optimizer-matches-chain", same,
                  digest=common.digest(np.asarray(results[1]["a"])))


def two_devices(rank: int, nproc: int, ndev: int, hosts) -> None:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    split = NamedSharding(mesh, P("d"))
    n = nproc * ndev

    def global_rows(local):
        return jax.make_array_from_process_local_data(split, local, (n, *local.shape[1:]))

    def per_device(out):
        return [np.asarray(s.data)[0] for s in sorted(out.addressable_shards,
                                                      key=lambda s: s.device.id)]

    for salt, dtype in enumerate(("float32", "bfloat16")):
        xs = [[common.make_input(dtype, 4097, p * ndev + d, salt) for d in range(ndev)]
              for p in range(nproc)]
        ws = [[weight_of(p * ndev + d, salt) for d in range(ndev)] for p in range(nproc)]
        want = common.weighted_reference(dtype, xs, ws, hosts)
        x = global_rows(np.stack(xs[rank]))
        w = global_rows(np.asarray(ws[rank], np.float32))
        for name, fn in (("pmean", lambda x, w: herring_jax.pmean(x, "d", weight=w[0])),
                         ("allreduce", lambda x, w: herring_jax.allreduce(
                             x, op="mean", weight=w[0]))):
            f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("d"), P("d")),
                                      out_specs=P("d") if name == "allreduce" else P()))
            out = f(x, w)
            got = per_device(out) if name == "allreduce" else [np.asarray(
                out.addressable_shards[0].data)[0]]
            check(f"{name}/{dtype}/{ndev}dev", got, want)

    # allreduce_gradients("d", weight=True) inside shard_map (pmap semantics).
    tx = herring_jax.allreduce_gradients("d", weight=True, fusion_bytes=32)
    trees = [[grads(p * ndev + d, 0) for d in range(ndev)] for p in range(nproc)]
    ws = [[weight_of(p * ndev + d, 7) for d in range(ndev)] for p in range(nproc)]
    want = tree_reference(trees, ws, hosts)
    g = {k: global_rows(np.stack([t[k] for t in trees[rank]])) for k in SHAPES}

    def step(g, w):
        g = jax.tree_util.tree_map(lambda v: v[0], g)
        out, _ = tx.update(g, tx.init(g), None, weight=w[0])
        return jax.tree_util.tree_map(lambda v: v[None], out)

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"),
                              check_vma=False))
    out = f(g, global_rows(np.asarray(ws[rank], np.float32)))
    ok = all(common.bitwise_equal(v, want[k]) for k in SHAPES for v in per_device(out[k]))
    common.report(f"allreduce_gradients/{ndev}dev", ok,
                  digest=common.digest(per_device(out["a"])[0]))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)  # the float64 cases
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    hosts = common.hosts_from_env(nproc)
    if args.devices == 1:
        one_device(rank, nproc, hosts)
    else:
        two_devices(rank, nproc, args.devices, hosts)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
