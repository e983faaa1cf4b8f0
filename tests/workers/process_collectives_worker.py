"""herring_jax.reduce_scatter / allgather / barrier and allreduce(op="max" |
"min") across processes, against numpy: bitwise, in herring's documented
order (tests/workers/common.reference: the host layout comes from
HERRING_TEST_HOSTS), eager and in jit, with sizes that do not divide by the
number of processes, gradients (lax's convention), vmap and the errors.

Run on its own (any number of processes, one device each or more) or from
collectives_worker.py, which calls run_cases after its own cases.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
from compat_worker import raises  # noqa: E402
import herring_jax  # noqa: E402

# (name, dtype, shape) of the leaves reduce_scatter takes; sizes 10, 7, 1, 0,
# 15, 13 and 9 do not divide by 2, 3 or 4 processes (or do by some).
LEAVES = [("a", "float32", (10,)), ("b", "float32", (7,)), ("c", "float32", (1,)),
          ("empty", "float32", (0,)), ("m", "float32", (3, 5)), ("i", "int32", (13,)),
          ("h", "bfloat16", (9,)), ("d", "float64", (12,))]


def leaf(dtype, shape, rank, salt):
    return common.make_input(dtype, int(np.prod(shape)), rank, salt).reshape(shape)


def tree_of(rank, salt):
    return {name: leaf(dt, shape, rank, salt) for name, dt, shape in LEAVES}


def part(flat_sum, rank, nproc):
    """The documented cut: B = ceil(size / N) elements from rank * B, zero-padded."""
    b = -(-flat_sum.size // nproc)
    padded = np.concatenate([flat_sum, np.zeros(b * nproc - flat_sum.size, flat_sum.dtype)])
    return padded[rank * b:(rank + 1) * b]


def run_cases(me: int, nproc: int) -> None:
    hosts = common.hosts_from_env(nproc)
    everyone = [tree_of(r, 1) for r in range(nproc)]
    mine = jax.tree.map(jnp.asarray, everyone[me])
    bools = [leaf("int32", (11,), r, 2) % 3 == 0 for r in range(nproc)]

    # -- reduce_scatter: sum and mean, eager and jit, bitwise the reference.
    for op in ("sum", "mean"):
        names = [n for n, dt, _ in LEAVES if op == "sum" or not dt.startswith("int")]
        tree = {n: mine[n] for n in names}
        for mode, fn in (("eager", herring_jax.reduce_scatter),
                         ("jit", jax.jit(herring_jax.reduce_scatter, static_argnums=1))):
            got = fn(tree, op)
            bad = []
            for n in names:
                dt = dict((k, d) for k, d, _ in LEAVES)[n]
                total = common.reference(dt, op, [[e[n].reshape(-1)] for e in everyone], hosts)
                if not common.bitwise_equal(np.asarray(got[n]), part(total, me, nproc)):
                    bad.append(n)
            common.report(f"reduce_scatter/{op}/{mode}", not bad, bad=bad)
    # bool is summed as int32; the parts, gathered and cut, are allreduce's.
    got = herring_jax.reduce_scatter(jnp.asarray(bools[me]))
    want = part(sum(b.astype(np.int32) for b in bools), me, nproc)
    whole = herring_jax.allreduce(mine)
    gathered = herring_jax.allgather(herring_jax.reduce_scatter(mine))
    common.report("reduce_scatter/bool-and-parts-are-allreduce",
                  common.bitwise_equal(np.asarray(got), want) and all(
                      common.bitwise_equal(np.asarray(gathered[n]).reshape(-1)[:whole[n].size],
                                           np.asarray(whole[n]).reshape(-1))
                      for n in whole))

    # -- allgather: every dtype kind, eager and jit, exact.
    gather_in = [{"f": leaf("float32", (3, 2), r, 3), "i8": (leaf("int32", (5,), r, 3) % 100)
                  .astype(np.int8), "b": bools[r], "c": (leaf("float32", (4,), r, 4)
                                                         * (1 + 1j)).astype(np.complex64),
                  "bf": leaf("bfloat16", (2,), r, 5), "empty": np.zeros((0, 3), np.float32)}
                 for r in range(nproc)]
    for mode, fn in (("eager", herring_jax.allgather), ("jit", jax.jit(herring_jax.allgather))):
        got = fn(jax.tree.map(jnp.asarray, gather_in[me]))
        bad = [k for k in gather_in[me] if not common.bitwise_equal(
            np.asarray(got[k]), np.stack([g[k] for g in gather_in]))]
        common.report(f"allgather/{mode}", not bad, bad=bad)

    # -- derivatives (lax's convention: the transposes are each other).
    v = jnp.asarray(leaf("int32", (10,), me, 6).astype(np.float32) % 7)
    b = -(-10 // nproc)
    block_of = np.arange(10) // b  # which process's part each element is in

    # Per-process values are arguments: a constant of its own would compile
    # another program on every process, whose reductions never meet.
    c = jnp.float32(me + 1.0)

    def rs_loss(u, c):
        return (herring_jax.reduce_scatter(u * u) * c).sum()

    w = jnp.asarray(np.stack([np.full((10,), (r + 1.0) * (me + 2.0), np.float32)
                              for r in range(nproc)]))

    def ag_loss(u, w):
        return (herring_jax.allgather(u) * w).sum()

    tri = sum(q + 2.0 for q in range(nproc))
    checks = {}
    for mode, wrap in (("eager", lambda f: f), ("jit", jax.jit)):
        ct = jnp.ones((b,), jnp.float32) * (me + 1.0)
        checks[f"{mode}/grad-reduce_scatter"] = np.array_equal(
            wrap(jax.grad(rs_loss))(v, c), 2 * np.asarray(v) * (block_of + 1))
        # The loss summed over processes q is sum_q sum_r W_q[r] * x_r, with
        # W_q[r] = (r + 1)(q + 2): d/dx_me = (me + 1) * sum_q (q + 2).
        checks[f"{mode}/grad-allgather"] = np.array_equal(
            wrap(jax.grad(ag_loss))(v, w), np.full((10,), (me + 1.0) * tri, np.float32))
        checks[f"{mode}/transpose-mean"] = np.allclose(wrap(jax.linear_transpose(
            lambda u: herring_jax.reduce_scatter(u, "mean"), v))(ct)[0],
            (block_of + 1.0) / nproc, rtol=1e-6)
        primal, tangent = wrap(lambda p, t: jax.jvp(
            lambda u: herring_jax.reduce_scatter(u * u), (p,), (t,)))(v, v)
        checks[f"{mode}/jvp"] = np.array_equal(tangent, 2 * np.asarray(primal))
        vs = jnp.stack([v, 2 * v])
        checks[f"{mode}/vmap"] = (
            np.array_equal(wrap(jax.vmap(herring_jax.reduce_scatter))(vs),
                           np.stack([herring_jax.reduce_scatter(v),
                                     herring_jax.reduce_scatter(2 * v)]))
            and np.array_equal(wrap(jax.vmap(herring_jax.allgather))(vs),
                               np.stack([herring_jax.allgather(v),
                                         herring_jax.allgather(2 * v)])))
    common.report("derivatives-and-vmap", all(checks.values()),
                  failed=[k for k, ok in checks.items() if not ok])

    # -- allreduce max / min: NaN wins, bool stays bool, eager and jit.
    xs = [leaf("float32", (6,), r, 7) for r in range(nproc)]
    if nproc > 1:
        xs[1][2] = np.nan
    ints = [leaf("int32", (5,), r, 8) for r in range(nproc)]
    checks = {}
    for mode, wrap in (("eager", lambda f: f), ("jit", jax.jit)):
        for op, red in (("max", np.maximum), ("min", np.minimum)):
            got = wrap(lambda t, op=op: herring_jax.allreduce(t, op))(
                {"f": jnp.asarray(xs[me]), "i": jnp.asarray(ints[me]),
                 "b": jnp.asarray(bools[me])})
            checks[f"{mode}/{op}"] = (
                common.bitwise_equal(np.asarray(got["f"]), red.reduce(xs))
                and common.bitwise_equal(np.asarray(got["i"]), red.reduce(ints))
                and common.bitwise_equal(np.asarray(got["b"]), red.reduce(bools)))
    common.report("allreduce/max-min", all(checks.values()),
                  failed=[k for k, ok in checks.items() if not ok])

    # -- a wire codec: reduce_scatter's parts are bitwise allreduce's.
    size = 512 * nproc - (nproc > 1)  # B = 512; the last part ends in a zero
    big = jnp.asarray(leaf("float32", (size,), me, 9))
    rs = herring_jax.reduce_scatter(big, codec="bf16")
    ar = herring_jax.allreduce(big, codec="bf16")
    common.report("reduce_scatter/codec-bf16", common.bitwise_equal(
        np.asarray(rs), part(np.asarray(ar), me, nproc)))

    # -- barrier: returns, eager and inside jit.
    herring_jax.barrier()
    inside = jax.jit(lambda u: (herring_jax.barrier(), u + 1)[1])(v)
    common.report("barrier", np.array_equal(inside, np.asarray(v) + 1))

    errors(nproc, v)
    common.report("stats", True, stats=herring_jax.stats())


def errors(nproc, v):
    checks = {
        "op": raises(ValueError, herring_jax.reduce_scatter, v, "max"),
        "mean-of-int": raises(TypeError, herring_jax.reduce_scatter, v.astype(jnp.int32),
                              "mean"),
        "max-codec": raises(ValueError, lambda: herring_jax.allreduce(v, "max", codec="bf16")),
        "max-complex": raises(TypeError, herring_jax.allreduce, v.astype(jnp.complex64), "max"),
        "max-grad": raises(NotImplementedError, jax.grad(
            lambda u: herring_jax.allreduce(u, "max").sum()), v),
        "dtype": raises(TypeError, herring_jax.allgather, np.array(["a", "b"])),
    }
    if nproc > 1:
        checks["codec-block"] = raises(ValueError, lambda: herring_jax.reduce_scatter(
            jnp.ones(nproc * 100, jnp.float32), codec="bf16"))
    if jax.local_device_count() > 1:
        # A jit over this process's devices: one device per process, please.
        mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("l",))
        spread = jax.device_put(jnp.ones((jax.local_device_count(), 4), jnp.float32),
                                jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("l")))
        checks["one-device-per-process"] = raises(ValueError, jax.jit(
            herring_jax.reduce_scatter), spread)
    common.report("process-errors", all(ok for ok, _ in checks.values()),
                  failed={k: w for k, (ok, w) in checks.items() if not ok})


def main() -> int:
    jax.config.update("jax_enable_x64", True)  # the float64 leaf
    herring_jax.initialize()
    run_cases(herring_jax.process_index(), herring_jax.process_count())
    herring_jax.shutdown()
    return 0



if __name__ == "__main__":
    sys.exit(main())
