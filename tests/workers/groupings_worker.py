"""Reductions that group the same local devices differently, interleaved:
psum over different axes of one mesh, several meshes, shapes and dtypes, in a
shuffled order (the same on every process), repeated; a psum in a loop; and
computations dispatched back to back without waiting. Every result is
compared with jax.lax.psum/pmean. Before the meeting point was keyed by
execution, the second grouping timed out and memory was corrupted."""

from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402


def shards(a):
    return [np.asarray(s.data) for s in sorted(a.addressable_shards, key=lambda s: s.device.id)]


def same(a, b):
    sa, sb = shards(a), shards(b)
    if len(sa) != len(sb):
        return False
    if np.issubdtype(sa[0].dtype, np.integer):
        return all(np.array_equal(x, y) for x, y in zip(sa, sb))
    return all(np.allclose(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(sa, sb))


def main() -> int:
    herring_jax.initialize()
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    meshes = {
        "2x2": jax.sharding.Mesh(devices.reshape(2, 2), ("x", "y")),
        "2x2-t": jax.sharding.Mesh(devices.reshape(2, 2).T, ("x", "y")),
        "4": jax.sharding.Mesh(devices, ("i",)),
    }
    cases = []
    for mesh_name, mesh in meshes.items():
        names = mesh.axis_names
        axes_list = [names[0]] if len(names) == 1 else ["y", ("x", "y"), "x", ("y", "x")]
        for axes in axes_list:
            for dtype, width in [("float32", 24), ("int32", 24), ("float32", 7)]:
                for op in ("psum", "pmean") if dtype == "float32" else ("psum",):
                    cases.append((mesh_name, axes, dtype, width, op))
    spec_of = {"2x2": P("x", "y"), "2x2-t": P("x", "y"), "4": P("i")}
    shape_of = {"2x2": lambda w: (4, 2 * w), "2x2-t": lambda w: (4, 2 * w),
                "4": lambda w: (4, w)}

    def inputs(mesh_name, dtype, width, salt):
        mesh = meshes[mesh_name]
        shape = shape_of[mesh_name](width)
        full = common.make_input(dtype, int(np.prod(shape)), 0, salt).reshape(shape)
        return jax.device_put(full, NamedSharding(mesh, spec_of[mesh_name]))

    def program(mesh_name, axes, op, lib):
        fn = getattr(lib, op)
        spec = spec_of[mesh_name]
        return jax.jit(jax.shard_map(lambda v: fn(v, axes), mesh=meshes[mesh_name],
                                     in_specs=spec, out_specs=spec, check_vma=False))

    rng = random.Random(1234)  # the same order on every process
    order = cases * 3
    rng.shuffle(order)
    ok = True
    for n, (mesh_name, axes, dtype, width, op) in enumerate(order):
        x = inputs(mesh_name, dtype, width, n)
        a = program(mesh_name, axes, op, herring_jax)(x)
        b = program(mesh_name, axes, op, jax.lax)(x)
        if not same(a, b):
            ok = False
            print(f"mismatch at step {n}: {mesh_name} {axes} {dtype}[{width}] {op}", flush=True)
    common.report("shuffled-groupings", ok, steps=len(order))

    # Two groupings dispatched back to back without waiting, then read.
    x = inputs("2x2", "float32", 16, 99)
    f = program("2x2", "y", "psum", herring_jax)
    g = program("2x2", ("x", "y"), "psum", herring_jax)
    outs = [f(x), g(x), f(x), g(x)]
    refs = [program("2x2", "y", "psum", jax.lax)(x), program("2x2", ("x", "y"), "psum", jax.lax)(x)]
    common.report("no-wait-dispatch", all(same(o, refs[i % 2]) for i, o in enumerate(outs)))

    # One call site that runs several times per device in one execution.
    mesh = meshes["2x2"]

    def loop(lib):
        def body(v):
            return jax.lax.fori_loop(0, 5, lambda i, acc: lib.psum(acc, "y") * 0.5, v)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x", "y"),
                                     out_specs=P("x", "y"), check_vma=False))
    common.report("loop", same(loop(herring_jax)(x), loop(jax.lax)(x)))

    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
