"""Reductions that only the identity (run, slot, instance, occurrence, buffer)
tells apart, never their start order: every result is exact on every
rank (small integers in float32, so any mispairing changes the sum).

  match: (a) a jitted helper with one reduction called twice (and three
    times) inside another jit on independent inputs of equal shapes; (b) two
    different jitted functions with equal-shape reductions dispatched back to
    back without waiting, several times, read at the end; (c) a train step and
    an eval step alternating without waiting; (d) a reduction in a
    lax.fori_loop; with several devices per process also (a) as a psum over a
    mesh axis in shard_map.
  extra-launch: rank 1 launches a reducing function once more than rank 0 (its
    reduction skipped by lax.cond), so the next launch has another run id on
    rank 1: every rank must raise HerringError within HERRING_TIMEOUT_S (it
    reports the run ids its message names).
  different-programs: each rank compiles its own executable of one program
    (see case_different_programs); run under HERRING_IDENTITY=launch (exact)
    and =program (every rank fails, naming another executable of the program).
  prune: many launches, then an idle pause longer than the occurrence
    counters' idle limit (8 x HERRING_TIMEOUT_S): the counters are pruned.
"""

from __future__ import annotations

import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

N = 1000


def contribution(rank: int, salt: int) -> np.ndarray:
    """Small integers as float32, different per rank and salt: sums are exact."""
    return ((np.arange(N) * (salt + 3) + rank * 7 + salt) % 97).astype(np.float32)


def total(size: int, salt: int) -> np.ndarray:
    return sum(contribution(r, salt) for r in range(size))


def case_helper_twice(rank: int, size: int) -> None:
    @jax.jit
    def helper(v):
        return herring_jax.allreduce(v)

    @jax.jit
    def twice(a, b):
        return helper(a), helper(b)

    @jax.jit
    def thrice(a, b, c):
        return helper(a), helper(b), helper(c)

    ok = True
    for step in range(4):
        outs = twice(contribution(rank, 10 * step), contribution(rank, 10 * step + 1))
        outs += thrice(*[contribution(rank, 10 * step + k) for k in (2, 3, 4)])
        salts = [10 * step + k for k in (0, 1, 2, 3, 4)]
        ok &= all(np.array_equal(np.asarray(o), total(size, s)) for o, s in zip(outs, salts))
    common.report("helper-twice", ok)


def case_no_wait(rank: int, size: int) -> None:
    f = jax.jit(lambda v: herring_jax.allreduce(v) + 0.0)
    g = jax.jit(lambda v: herring_jax.allreduce(v) * 1.0)
    outs, salts = [], []
    for step in range(6):
        outs.append(f(contribution(rank, 100 + 2 * step)))
        outs.append(g(contribution(rank, 101 + 2 * step)))
        salts += [100 + 2 * step, 101 + 2 * step]
    ok = all(np.array_equal(np.asarray(o), total(size, s)) for o, s in zip(outs, salts))
    common.report("no-wait", ok)


def case_train_eval(rank: int, size: int) -> None:
    @jax.jit
    def train(w, x):
        grad = herring_jax.allreduce(x * w)  # equal shape to eval's reduction
        return w - grad * 2.0 ** -12

    @jax.jit
    def evaluate(w, y):
        return herring_jax.allreduce(y + w * 0.0)

    w = jnp.ones(N, jnp.float32)
    ws, evals = [], []
    for step in range(5):
        x = contribution(rank, 200 + step)
        y = contribution(rank, 300 + step)
        evals.append(evaluate(w, y))  # not waited for: runs beside the next train
        w = train(w, x)
        ws.append(w)
    # Reference, in numpy with the same float32 operations.
    ref_w = np.ones(N, np.float32)
    ok = True
    for step in range(5):
        ok &= np.array_equal(np.asarray(evals[step]), total(size, 300 + step))
        grad = sum(contribution(r, 200 + step) * ref_w for r in range(size))
        ref_w = ref_w - grad * np.float32(2.0 ** -12)
        ok &= np.array_equal(np.asarray(ws[step]), ref_w)
    common.report("train-eval", bool(ok))


def case_loop(rank: int, size: int) -> None:
    @jax.jit
    def looped(v):
        return jax.lax.fori_loop(0, 5, lambda i, acc: herring_jax.allreduce(acc) * 0.5 + i, v)

    out = looped(contribution(rank, 400))
    accs = [contribution(r, 400) for r in range(size)]
    for i in range(5):
        s = sum(accs)
        accs = [s * np.float32(0.5) + np.float32(i)] * size
    common.report("fori-loop", np.array_equal(np.asarray(out), accs[0]))


def case_psum_helper_twice(rank: int, size: int) -> None:
    """(a) across the devices of a mesh: each inlined copy meets its own local
    devices (the local meeting is keyed by instruction, not call site)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    mesh = jax.sharding.Mesh(devices, ("i",))

    @jax.jit
    def helper(v):
        return herring_jax.psum(v, "i")

    def body(a, b):
        return helper(a), helper(b)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P("i")),
                              out_specs=(P("i"), P("i")), check_vma=False))
    n = len(devices)
    full_a = np.concatenate([contribution(d, 500) for d in range(n)])
    full_b = np.concatenate([contribution(d, 501) for d in range(n)])
    sharding = NamedSharding(mesh, P("i"))
    out_a, out_b = f(jax.device_put(full_a, sharding), jax.device_put(full_b, sharding))
    ok = True
    for out, salt in ((out_a, 500), (out_b, 501)):
        expected = sum(contribution(d, salt) for d in range(n))
        ok &= all(np.array_equal(np.asarray(s.data), expected) for s in out.addressable_shards)
    common.report("psum-helper-twice", bool(ok))


def extra_launch(rank: int) -> None:
    @jax.jit
    def maybe(v, reduce):
        return jax.lax.cond(reduce, herring_jax.allreduce, lambda u: u, v)

    x = np.ones(N, np.float32)
    # Rank 1 launches once more, without a reduction. (From the same source
    # line as every other launch: XLA's fingerprint, hence the run id, covers
    # the traceback of the call that first traced the function.)
    flags = [False, True] if rank == 1 else [True]
    start = time.monotonic()
    try:
        with herring_jax.herring_errors():
            for flag in flags:
                jax.block_until_ready(maybe(x, flag))
    except herring_jax.HerringError as e:
        # ok: it failed, as it must. Whether its message names both runs is
        # the caller's to judge: a rank that fails after a peer has already
        # failed and exited may name that exit instead.
        text = str(e)
        runs = set(re.findall(r"\brun (-?\d+)", text))
        common.report("extra-launch", True, seconds=time.monotonic() - start,
                      runs=sorted(runs), message=text[:1500])
    else:
        common.report("extra-launch", False, message="no error")


def prune(rank: int, size: int) -> None:
    f = jax.jit(lambda v: herring_jax.allreduce(v))
    for step in range(30):
        f(contribution(rank, step))
    jax.block_until_ready(f(contribution(rank, 0)))
    before = herring_jax.stats()["occurrence_entries"]
    idle = 8 * float(os.environ["HERRING_TIMEOUT_S"]) + 2
    time.sleep(idle)
    out = f(contribution(rank, 7))
    after = herring_jax.stats()["occurrence_entries"]
    common.report("prune", before >= 31 and after == 1 and
                  np.array_equal(np.asarray(out), total(size, 7)), before=before, after=after)


def case_different_programs(rank: int, size: int) -> None:
    """Each rank compiles its own executable of one program: a rank-dependent
    constant outside the reductions gives each its own XLA fingerprint, hence
    its own run ids, as XLA:CUDA's per-process kernel choices do. Under the
    launch identity every reduction still meets its peers' (two call sites,
    a loop, a matrix product beside them); under the program identity none
    does, which shows the fingerprints really differ."""
    offset = np.float32(rank + 1)
    w = jnp.asarray(np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64))

    @jax.jit
    def step(v, u, w):
        a = herring_jax.allreduce(v)
        b = jax.lax.fori_loop(0, 3, lambda i, acc: herring_jax.allreduce(acc) * 0.5, u)
        return a, b, jnp.tanh(w @ w.T) + offset

    start = time.monotonic()
    ok = True
    try:
        with herring_jax.herring_errors():
            for launch in range(4):
                a, b, _ = step(contribution(rank, 600 + launch), contribution(rank, 700 + launch),
                               w)
                ok &= np.array_equal(np.asarray(a), total(size, 600 + launch))
                ref = [contribution(r, 700 + launch) for r in range(size)]
                for _ in range(3):
                    ref = [sum(ref) * np.float32(0.5)] * size
                ok &= np.array_equal(np.asarray(b), ref[0])
    except herring_jax.HerringError as e:
        common.report("different-programs", False, error=True,
                      seconds=time.monotonic() - start, message=str(e)[:1500])
        return
    common.report("different-programs", bool(ok), error=False)


def main() -> int:
    herring_jax.initialize()
    rank, size = herring_jax.process_index(), herring_jax.process_count()
    mode = sys.argv[1]
    if mode == "extra-launch":
        extra_launch(rank)
        sys.stdout.flush()
        os._exit(0)  # skip jax.distributed's shutdown barrier: the job is broken
    if mode == "prune":
        prune(rank, size)
    elif mode == "different-programs":
        case_different_programs(rank, size)
        if os.environ.get("HERRING_IDENTITY") == "program":
            sys.stdout.flush()
            os._exit(0)  # the job is broken, as it should be: skip the shutdown barrier
    else:
        case_helper_twice(rank, size)
        case_no_wait(rank, size)
        case_train_eval(rank, size)
        case_loop(rank, size)
        if jax.local_device_count() > 1:
            case_psum_helper_twice(rank, size)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
