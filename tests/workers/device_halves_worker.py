"""The two halves (reduce-scatter, all-gather) through the start/done handler
code of a device with a stream (xla_ffi/device_handlers.cc): XLA:CUDA's on a
GPU (the GPU check, tests/gpu/), the device layer's CPU double on CPU devices
(HERRING_TEST_DEVICE_DOUBLE=1, set by the caller). Usage:
device_halves_worker.py MODE [RANK:FAULT ...], each FAULT the
HERRING_TEST_DEVICE_FAULT (the double's fault hook) of that rank.

  collectives: reduce_scatter (sum; mean for float32) and allgather of 6
    dtypes at sizes 1, 1001 and 4099 (uneven for 2 and 3 processes), and
    psum_scatter / all_gather (tiled) inside jax.shard_map, bitwise against
    numpy; each program must lower to the device's start and done. On the
    double, also: it must have copied every operand to the host and every
    result, of its own size (an all-gather's N times its operand), back.
  sharded (the double only): sharded_optimizer (ZeRO-1; also with the int8
    codec and error feedback) and fully_sharded (ZeRO-3) with adam on a small
    model, 2 steps, through the double and then
    without it: the parameters must be bitwise equal, the first run's bytes
    must all have gone through the double (copies each way, one back for each
    in) and the second's none.
  flax: sharded_optimizer and fully_sharded with adam on a small Flax Linen
    MLP against optax.chain(allreduce_gradients(), adam), 4 steps, bitwise.
  gather-fault (the double only): allgather until HerringError, one rank's
    copy failed by the fault hook (set by the caller); that rank lets its
    error go uncaught, so that its process fails and aborts the job; every
    rank reports its error.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax import _herring_ffi  # noqa: E402
from device_double_worker import DTYPES, check, fails_on, inputs, start  # noqa: E402
from process_collectives_worker import part  # noqa: E402
from sharded_worker import batch, flat, loss_fn, make_params  # noqa: E402

SIZES = (1, 1001, 4099)
STEPS = 2


def on_the_double() -> bool:
    return jax.default_backend() == "cpu"


def lowered_to_the_pair(fn, *args) -> bool:
    """Whether `fn` lowers to this platform's start and done (the double's on
    CPU devices, XLA:CUDA's on a GPU) and no XLA:CPU call."""
    prefix = "herring_double_allreduce" if on_the_double() else "herring_allreduce"
    text = jax.jit(fn).lower(*args).as_text()
    return (f"@{prefix}_start(" in text and f"@{prefix}_done(" in text
            and "@herring_allreduce(" not in text)


def stats_delta(before: dict) -> dict:
    after = _herring_ffi.device_double_stats()
    return {k: after[k] - before[k] for k in after}


def collectives(rank: int, n: int) -> None:
    before = _herring_ffi.device_double_stats()
    to_host = to_device = 0  # bytes each way through the double
    for dtype in DTYPES:
        for count in SIZES:
            xs = inputs(dtype, count, count % 5, n)
            for op in ("sum", "mean") if dtype == "float32" else ("sum",):
                fn = jax.jit(lambda v, op=op: herring_jax.reduce_scatter(v, op))
                want = part(common.reference(dtype, op, [[x] for x in xs]), rank, n)
                got = fn(xs[rank])
                # No digest: each rank's part differs.
                common.report(f"reduce_scatter-{dtype}-{count}-{op}",
                              common.bitwise_equal(np.asarray(got), want),
                              paired=lowered_to_the_pair(fn, xs[rank]))
                # The operand, padded to N parts; the part back.
                to_host += n * np.asarray(got).nbytes
                to_device += np.asarray(got).nbytes
            fn = jax.jit(herring_jax.allgather)
            got = fn(xs[rank])
            check(f"allgather-{dtype}-{count}", got, np.stack(xs),
                  paired=lowered_to_the_pair(fn, xs[rank]))
            to_host += xs[rank].nbytes
            to_device += n * xs[rank].nbytes  # the whole gathered array back

    # The lax drop-ins inside shard_map over one device per process: blocks
    # named by device (device_blocks), not by process.
    mesh = jax.make_mesh((n,), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    xs = [common.make_input("float32", 6 * n, r, 3) for r in range(n)]
    x = jax.make_array_from_process_local_data(sharding, xs[rank][None], (n, 6 * n))
    smap = jax.jit(jax.shard_map(
        lambda v: (herring_jax.psum_scatter(v[0], "d", tiled=True)[None],
                   herring_jax.all_gather(v[0][:5], "d", tiled=True)[None]),
        mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d"))))
    scattered, gathered = (np.asarray(a.addressable_shards[0].data[0]) for a in smap(x))
    total = common.reference("float32", "sum", [[v] for v in xs])
    ok = (common.bitwise_equal(scattered, total[6 * rank:6 * (rank + 1)])
          and common.bitwise_equal(gathered, np.concatenate([v[:5] for v in xs])))
    common.report("shard_map-psum_scatter-all_gather", ok,
                  paired=lowered_to_the_pair(smap, x))
    to_host += xs[rank].nbytes + 5 * 4
    to_device += 6 * 4 + 5 * 4 * n

    if not on_the_double():
        return
    delta = stats_delta(before)
    common.report("double-copied", delta["bytes_to_host"] == to_host
                  and delta["bytes_to_device"] == to_device and delta["failed"] == 0,
                  to_host=to_host, to_device=to_device, **delta)


def train_sharded(rank: int, compression: str = "none"):
    params = make_params("float32")
    tx = herring_jax.sharded_optimizer(optax.adam(1e-2), compression=compression)
    state = tx.init(params)

    @jax.jit
    def step(params, state, x):
        updates, state = tx.update(jax.grad(loss_fn)(params, x), state, params)
        return optax.apply_updates(params, updates), state

    text = step.lower(params, state, batch(rank, 0)).as_text()
    for k in range(STEPS):
        params, state = step(params, state, batch(rank, k))
    return flat(params), text


def train_fully_sharded(rank: int):
    fs = herring_jax.fully_sharded(optax.adam(1e-2), fusion_bytes=1024, first_bucket_bytes=1024)
    state = fs.init(make_params("float32"))

    @jax.jit
    def step(state, x):
        _, grads = fs.value_and_grad(loss_fn)(state, x)
        return fs.apply_gradients(state, grads)

    text = step.lower(state, batch(rank, 0)).as_text()
    for k in range(STEPS):
        state = step(state, batch(rank, k))
    return flat(jax.jit(fs.gather)(state)), text


def sharded(rank: int) -> None:
    for name, train in (("sharded_optimizer", train_sharded),
                        # Error feedback: each reduce-scatter also returns its losses.
                        ("sharded_optimizer-int8", lambda r: train_sharded(r, "int8")),
                        ("fully_sharded", train_fully_sharded)):
        runs = {}
        for double in (True, False):
            # Read when a reduction is lowered: every program is lowered anew.
            os.environ["HERRING_TEST_DEVICE_DOUBLE"] = "1" if double else "0"
            jax.clear_caches()
            before = _herring_ffi.device_double_stats()
            got, text = train(rank)
            runs[double] = (got, text, stats_delta(before))
        (got, text, through), (want, plain, around) = runs[True], runs[False]
        # One copy back per copy in, and with error feedback each
        # reduce-scatter's losses too.
        losses = STEPS * text.count("collective = 1 :") if name.endswith("int8") else 0
        ok = (common.bitwise_equal(got, want)
              and "herring_double_allreduce_start" in text and "@herring_allreduce(" not in text
              and "herring_double_allreduce_start" not in plain and "@herring_allreduce(" in plain
              and through["copies_to_host"] > 0
              and through["copies_to_device"] == through["copies_to_host"] + losses
              and through["failed"] == 0
              and around["copies_to_host"] == around["copies_to_device"] == 0)
        common.report(name, ok, digest=common.digest(got),
                      max_diff=float(np.max(np.abs(got - want))), losses=losses,
                      through=through, around=around)
    os.environ["HERRING_TEST_DEVICE_DOUBLE"] = "1"


def flax(rank: int) -> None:
    from fully_sharded_worker import flax_models, train_fully_sharded as train_fs
    from sharded_worker import train

    params, loss = flax_models()["linen"]
    ref, _ = train(optax.chain(herring_jax.allreduce_gradients(), optax.adam(1e-2)), params,
                   rank, loss_fn=loss)
    runs = {"sharded_optimizer": train(herring_jax.sharded_optimizer(optax.adam(1e-2)),
                                       params, rank, loss_fn=loss)[0],
            "fully_sharded": train_fs(herring_jax.fully_sharded(optax.adam(1e-2)), params, rank,
                                      False, loss_fn=loss)[0]}
    want = flat(ref)
    for name, got in runs.items():
        got = flat(got)
        common.report(f"flax/{name}", common.bitwise_equal(got, want),
                      digest=common.digest(got), max_diff=float(np.max(np.abs(got - want))))


def main() -> int:
    mode, rank, n = start(sys.argv)
    if mode == "collectives":
        collectives(rank, n)
    elif mode == "sharded":
        sharded(rank)
    elif mode == "flax":
        flax(rank)
    elif mode == "gather-fault":
        fails_on(1, rank, n, fn=jax.jit(lambda v: herring_jax.allgather(v) + 1))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
