"""XLA:CUDA's start/done handler code (xla_ffi/device_handlers.cc) run on CPU
devices against the device layer's CPU double (HERRING_TEST_DEVICE_DOUBLE=1,
set by the test). Usage: device_double_worker.py MODE [RANK:FAULT ...], each
FAULT the HERRING_TEST_DEVICE_FAULT (the double's fault hook) of that rank.

  allreduce: every dtype at sizes 1 to 65537 (sum; mean for float32) bitwise
    against numpy; one jitted reduction launched three times (the launch
    identity's counting under HERRING_IDENTITY=launch); a helper inlined twice;
    a training step whose allreduce_gradients buckets are all started before
    any done. Each program must lower to the double's start and done and no
    herring_allreduce, and the double must have copied every byte both ways.
  delayed: as allreduce for float32 with one copy slowed by the fault hook
    (set by the test: a start's copy to the host on rank 0, a done's copy
    back on rank 1), the result used inside the jitted function after the
    done: the sums must be right, and the hook must have fired.
  killed: rank 2 of 3 is killed by the fault hook while its third copy to the
    host is in flight; ranks 0 and 1 must raise HerringError naming rank 2
    within HERRING_TIMEOUT_S.
  abort: rank 1's second copy to the host fails (the fault hook): its done
    must raise the double's error, which it lets go uncaught, so that the
    process fails and aborts the job; rank 0, whose own copy of that
    reduction is slowed, must fail at once naming rank 1.
  fail-back: as abort, but rank 0's first copy back to the device fails:
    its done must fail (its results were never written), not return them.
  timeout: rank 0's first copy to the host takes longer than
    HERRING_TIMEOUT_S + HERRING_CUDA_DONE_GRACE_S: its done must give up
    saying the device has not reached its copy; rank 1 must time out naming
    rank 0.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax import _herring_ffi  # noqa: E402

DTYPES = ("float32", "float64", "bfloat16", "float16", "int32", "int64")
SIZES = (1, 1000, 65537)
START, DONE = "herring_double_allreduce_start", "herring_double_allreduce_done"


def lowered_by_the_double(fn, *args) -> bool:
    text = jax.jit(fn).lower(*args).as_text()
    return (f"@{START}(" in text and f"@{DONE}(" in text
            and "@herring_allreduce(" not in text)


def inputs(dtype: str, count: int, salt: int, n: int) -> list[np.ndarray]:
    return [common.make_input(dtype, count, r, salt) for r in range(n)]


def check(case: str, got, want: np.ndarray, **fields) -> bool:
    got = np.asarray(got)
    ok = common.bitwise_equal(got, want)
    common.report(case, ok, digest=common.digest(got), **fields)
    return ok


def allreduce(rank: int, n: int) -> None:
    before = _herring_ffi.device_double_stats()
    moved = 0  # bytes each way through the double
    for dtype in DTYPES:
        for count in SIZES:
            for op in ("sum", "mean") if dtype == "float32" else ("sum",):
                xs = inputs(dtype, count, count % 7, n)
                fn = jax.jit(lambda v, op=op: herring_jax.allreduce(v, op=op))
                want = common.reference(dtype, op, [[x] for x in xs])
                check(f"{dtype}-{count}-{op}", fn(xs[rank]), want,
                      double=lowered_by_the_double(fn, xs[rank]))
                moved += xs[rank].nbytes

    # One program launched three times: its runs must pair in order.
    fn = jax.jit(lambda v: herring_jax.allreduce(v))
    for launch in range(3):
        xs = inputs("float32", 4099, 10 + launch, n)
        want = common.reference("float32", "sum", [[x] for x in xs])
        check(f"launch-{launch}", fn(xs[rank]), want)
        moved += xs[rank].nbytes

    # A jitted helper inlined twice: two instructions with equal attributes.
    helper = jax.jit(lambda v: herring_jax.allreduce(v))
    twice = jax.jit(lambda a, b: (helper(a), helper(b)))
    xs, ys = inputs("float32", 777, 20, n), inputs("float32", 777, 21, n)
    a, b = twice(xs[rank], ys[rank])
    ok = (common.bitwise_equal(np.asarray(a), common.reference("float32", "sum", [[x] for x in xs]))
          and common.bitwise_equal(np.asarray(b),
                                   common.reference("float32", "sum", [[y] for y in ys])))
    common.report("inlined-twice", ok, double=lowered_by_the_double(twice, xs[rank], ys[rank]))
    moved += 2 * xs[rank].nbytes

    # allreduce_gradients: one start per bucket, every done after every start.
    shapes = {"a": (64, 64), "b": (64,), "c": (64, 32), "d": (32,)}
    tx = herring_jax.allreduce_gradients(average=False, fusion_bytes=8 << 10,
                                         first_bucket_bytes=8 << 10)
    grads = [common.make_tree(shapes, r, 1) for r in range(n)]
    mine = {k: jnp.asarray(v) for k, v in grads[rank].items()}
    step = jax.jit(lambda g: tx.update(g, tx.init(g))[0])
    out = step(mine)
    text = step.lower(mine).as_text()
    ok = all(common.bitwise_equal(np.asarray(out[k]),
                                  common.reference("float32", "sum", [[g[k]] for g in grads]))
             for k in shapes)
    starts = text.count(f"@{START}(")
    common.report("gradients", ok and starts >= 3 and text.count(f"@{DONE}(") == starts,
                  buckets=starts)
    moved += sum(v.nbytes for v in grads[rank].values())

    after = _herring_ffi.device_double_stats()
    delta = {k: after[k] - before[k] for k in after}
    # Every byte went to the host and back through the double's streams.
    common.report("double-copied", delta["bytes_to_host"] == moved
                  and delta["bytes_to_device"] == moved and delta["failed"] == 0, moved=moved,
                  **delta)


def delayed(rank: int, n: int) -> None:
    fn = jax.jit(lambda v: herring_jax.allreduce(v) * 2)
    for step in range(3):
        xs = inputs("float32", 50_000, 30 + step, n)
        want = common.reference("float32", "sum", [[x] for x in xs]) * np.float32(2)
        check(f"delayed-{step}", fn(xs[rank]), want)
    stats = _herring_ffi.device_double_stats()
    fault = os.environ.get("HERRING_TEST_DEVICE_FAULT", "")
    # The start's copy was slow: herring's thread waited for it, in flight.
    waited = stats["waits_in_flight"] >= 1 if ":host:" in fault else True
    common.report("delay-fired", stats["delayed"] == (1 if fault else 0) and waited, **stats)


def failing(rank: int, n: int, case: str, expect: str, fn=None):
    """Reduces (`fn`, by default a jitted allreduce) until HerringError;
    reports whether its message has `expect` and returns the error."""
    fn = fn or jax.jit(lambda v: herring_jax.allreduce(v))
    for step in range(10):
        start = time.monotonic()
        try:
            with herring_jax.herring_errors():
                jax.block_until_ready(fn(np.full(1000, rank + step, np.float32)))
        except herring_jax.HerringError as e:
            seconds = time.monotonic() - start
            common.report(case, expect in str(e), step=step, seconds=seconds,
                          message=str(e)[:800])
            return e
    common.report(case, False, message="no error")
    return None


def fails_on(bad: int, rank: int, n: int, fn=None) -> None:
    """Rank `bad`'s copy fails (its fault hook): that rank raises the error
    uncaught, so that its process fails telling every other rank first; the
    others report the error naming it. (One call site on every rank: jax's
    lowering records where the jitted function was called, and under the
    program identity the ranks' programs must be the same.)"""
    error = failing(rank, n, "own" if rank == bad else "other",
                    "the CPU double's fault hook" if rank == bad else f"rank {bad} failed", fn=fn)
    if rank == bad:
        raise error or SystemExit(1)


def start(argv: list[str]) -> tuple[str, int, int]:
    """The mode (argv[1]), after each RANK:FAULT argument set this rank's fault
    hook, and herring_jax initialized: (mode, rank, processes)."""
    for arg in argv[2:]:
        who, _, fault = arg.partition(":")
        if int(who) == int(os.environ["HERRING_PROCESS_ID"]):
            os.environ["HERRING_TEST_DEVICE_FAULT"] = fault
    jax.config.update("jax_enable_x64", True)  # float64 and int64 cases
    herring_jax.initialize()
    return argv[1], jax.process_index(), jax.process_count()


def main() -> int:
    mode, rank, n = start(sys.argv)
    if mode == "allreduce":
        allreduce(rank, n)
    elif mode == "delayed":
        delayed(rank, n)
    elif mode == "killed":
        failing(rank, n, "killed", "rank 2")
    elif mode in ("abort", "fail-back"):
        fails_on(1 if mode == "abort" else 0, rank, n)
    elif mode == "timeout":
        failing(rank, n, "timeout", "has not reached its copy to the host" if rank == 0
                else "rank 0")
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
