"""A process's devices summed on the devices before the host copy
(HERRING_DEVICE_LOCAL_SUM, herring_jax/_src/collectives/local_sum.py), on
the CPU double (HERRING_TEST_DEVICE_DOUBLE=1): 2 processes of 2 CPU devices,
a psum over a mesh axis of all 4 (set by the test).

  psum-*: each dtype and op at sizes 1, 1001 (padded to a multiple of 2) and
    65537, in a jitted shard_map: bitwise against numpy's sum of each
    process's devices, then of the processes (the engine's documented order,
    which the local sum keeps for 2 devices per process), the same bits on
    every device; the program holds a reduce-scatter and an all-gather
    around the double's start and done.
  halved: the double copied 1/2 of each device's (padded) buffer to the host
    and back, not all of it: the bytes each way are the padded sizes once
    per process, where the host path copies them once per device.
  host-path: the same psum with the knob off: no reduce-scatter, each
    device's whole buffer copied (twice the bytes), the same bits.
  gradients: allreduce_gradients(axis_name) over the axis in a jitted
    training step (its buckets split into starts and dones): the sums
    bitwise, every bucket through a reduce-scatter.
  not-split: what keeps the host path (a boolean max is not tested: herring
    has no boolean sum): psum_scatter (a reduce-scatter of the axis itself)
    lowers with no XLA reduce-scatter of its own.
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax import _herring_ffi  # noqa: E402
from herring_jax._src.process import layout  # noqa: E402

START, DONE = "herring_double_allreduce_start", "herring_double_allreduce_done"
CASES = (("float32", "sum"), ("float32", "mean"), ("float32", "max"), ("bfloat16", "sum"),
         ("float16", "sum"), ("int32", "sum"), ("int32", "min"), ("float64", "sum"))
SIZES = (1, 1001, 65537)


def reference(dtype, op, inputs):
    if op in ("max", "min"):
        f = np.maximum if op == "max" else np.minimum
        return f.reduce([x for devs in inputs for x in devs])
    return common.reference(dtype, op, inputs)


def sharded(mesh, rows_of):
    """A global (4, count) array whose row i is device i's operand."""
    rows = np.stack([rows_of(i) for i in range(mesh.size)])
    return jax.make_array_from_callback(rows.shape, NamedSharding(mesh, P("data")),
                                        lambda idx: rows[idx])


def mine(out) -> list[np.ndarray]:
    return [np.asarray(s.data)[0] for s in out.addressable_shards]


def run_psum(mesh, dtype, op, count, salt):
    """(ok, program text, bytes of this process's operands, padded to 2)."""
    n = mesh.size
    per = len(jax.local_devices())
    inputs = [[common.make_input(dtype, count, p * per + d, salt) for d in range(per)]
              for p in range(n // per)]
    flat = [x for devs in inputs for x in devs]
    x = sharded(mesh, lambda i: flat[i])
    reduce = {"sum": herring_jax.psum, "mean": herring_jax.pmean, "max": herring_jax.pmax,
              "min": herring_jax.pmin}[op]
    fn = jax.jit(jax.shard_map(lambda v: reduce(v, "data"), mesh=mesh, in_specs=P("data"),
                               out_specs=P("data")))
    got = mine(fn(x))
    want = reference(dtype, op, inputs)
    ok = all(common.bitwise_equal(g, want) for g in got)
    padded = -(-count // per) * per * flat[0].itemsize
    return ok, fn.lower(x).as_text(), padded, common.digest(got[0])


def psum_cases(mesh) -> None:
    for dtype, op in CASES:
        for count in SIZES:
            before = _herring_ffi.device_double_stats()
            ok, text, padded, digest = run_psum(mesh, dtype, op, count, count % 5)
            after = _herring_ffi.device_double_stats()
            moved = {k: after[k] - before[k] for k in ("bytes_to_host", "bytes_to_device")}
            # On XLA:CPU the reduce-scatter is an all-gather and a sum
            # (local_sum._reduce_scatter_cpu says why): two all-gathers.
            lowered = (text.count("stablehlo.all_gather") == 2 and text.count(f"@{START}(") == 1
                       and text.count(f"@{DONE}(") == 1)
            # Both devices' halves together: the padded buffer once.
            halved = moved["bytes_to_host"] == moved["bytes_to_device"] == padded
            common.report(f"psum-{dtype}-{op}-{count}", ok and lowered and halved, digest=digest,
                          lowered=lowered, padded=padded, **moved)


def host_path(mesh) -> None:
    os.environ["HERRING_DEVICE_LOCAL_SUM"] = "0"
    try:
        before = _herring_ffi.device_double_stats()
        ok, text, padded, digest = run_psum(mesh, "float32", "sum", 1001, 1)
        after = _herring_ffi.device_double_stats()
    finally:
        os.environ["HERRING_DEVICE_LOCAL_SUM"] = "1"
    moved = after["bytes_to_host"] - before["bytes_to_host"]
    whole = 2 * 1001 * 4  # each of the 2 devices its whole buffer
    common.report("host-path", ok and "stablehlo.all_gather" not in text and moved == whole,
                  digest=digest, bytes_to_host=moved)


def gradients(mesh) -> None:
    shapes = {"a": (64, 64), "b": (65,), "c": (64, 33), "d": (31,)}
    per = len(jax.local_devices())
    trees = [common.make_tree(shapes, i, 1) for i in range(mesh.size)]
    tx = herring_jax.allreduce_gradients("data", average=False, fusion_bytes=8 << 10,
                                         first_bucket_bytes=8 << 10)
    spec = {k: P("data") for k in shapes}
    arrays = {k: sharded(mesh, lambda i, k=k: trees[i][k]) for k in shapes}

    def step(g):
        g = {k: v[0] for k, v in g.items()}
        out = tx.update(g, tx.init(g))[0]
        return {k: v[None] for k, v in out.items()}

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec,), out_specs=spec))
    out = fn(arrays)
    text = fn.lower(arrays).as_text()
    inputs = lambda k: [[trees[p * per + d][k] for d in range(per)]  # noqa: E731
                        for p in range(mesh.size // per)]
    ok = all(all(common.bitwise_equal(g, common.reference("float32", "sum", inputs(k)))
                 for g in mine(out[k])) for k in shapes)
    starts = text.count(f"@{START}(")
    gathers = text.count("stablehlo.all_gather")
    common.report("gradients", ok and starts >= 3 and gathers == 2 * starts
                  and text.count(f"@{DONE}(") == starts, buckets=starts, gathers=gathers)
    # The same step lowered for XLA:CUDA (its devices described as these CPU
    # devices, which is all this machine has): per bucket a reduce-scatter
    # then its start; every done after the last start, each followed by an
    # all-gather of its result.
    describe = layout._describe
    layout._describe = lambda devices, platform: describe(devices, "cpu")
    try:
        cuda = fn.trace(arrays).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        layout._describe = describe
    common.report("cuda-split", cuda_order(cuda) == "RS" * starts + "DA" * starts,
                  order=cuda_order(cuda))


def cuda_order(text: str) -> str:
    """The program's reduce-scatters (R), starts (S), dones (D) and
    all-gathers (A), in text order."""
    found = re.findall(r"stablehlo\.reduce_scatter|stablehlo\.all_gather|"
                       r"@herring_allreduce_start\(|@herring_allreduce_done\(", text)
    letter = {"stablehlo.reduce_scatter": "R", "stablehlo.all_gather": "A",
              "@herring_allreduce_start(": "S", "@herring_allreduce_done(": "D"}
    return "".join(letter[f] for f in found)


def not_split(mesh) -> None:
    x = sharded(mesh, lambda i: np.arange(8, dtype=np.float32) + i)
    fn = jax.jit(jax.shard_map(lambda v: herring_jax.psum_scatter(v[0], "data", tiled=True)[None],
                               mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    text = fn.lower(x).as_text()
    out = fn(x)
    want = sum(np.arange(8, dtype=np.float32) + i for i in range(mesh.size))
    where = [list(mesh.devices).index(s.device) for s in out.addressable_shards]
    ok = all(common.bitwise_equal(g, want[2 * i:2 * i + 2]) for i, g in zip(where, mine(out)))
    common.report("not-split", ok and "stablehlo.reduce_scatter" not in text)


def main() -> int:
    jax.config.update("jax_enable_x64", True)
    herring_jax.initialize()
    assert os.environ.get("HERRING_DEVICE_LOCAL_SUM") == "1"
    mesh = Mesh(np.array(jax.devices()), ("data",))
    assert [d.process_index for d in mesh.devices] == [0, 0, 1, 1], mesh.devices
    psum_cases(mesh)
    host_path(mesh)
    gradients(mesh)
    not_split(mesh)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
