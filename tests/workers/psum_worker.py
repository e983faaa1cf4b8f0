"""herring_jax.psum / pmean against jax.lax.psum / pmean (gloo across
processes) inside shard_map: 1-D and 2-D meshes, single axes and tuples,
invariant outputs, grad, jvp and vmap."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # lax.psum across processes

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402


def shards(a):
    return [np.asarray(s.data) for s in sorted(a.addressable_shards, key=lambda s: s.device.id)]


def same(a, b, exact=False):
    sa, sb = shards(a), shards(b)
    if exact:
        return len(sa) == len(sb) and all(np.array_equal(x, y) for x, y in zip(sa, sb))
    return len(sa) == len(sb) and all(np.allclose(x, y, rtol=1e-5, atol=1e-5)
                                      for x, y in zip(sa, sb))


def main() -> int:
    herring_jax.initialize()
    nproc = herring_jax.process_count()
    by_proc = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    ndev = by_proc.size
    local = ndev // nproc
    meshes = {
        "1d": jax.sharding.Mesh(by_proc, ("i",)),
        # 'data' across processes, 'model' across the devices of a process
        "2d": jax.sharding.Mesh(by_proc.reshape(nproc, local), ("data", "model")),
        # and the other way round
        "2d-t": jax.sharding.Mesh(by_proc.reshape(nproc, local).T, ("data", "model")),
    }
    axes_of = {"1d": ["i"], "2d": ["data", "model", ("data", "model")],
               "2d-t": ["data", "model", ("model", "data")]}

    for mesh_name, mesh in meshes.items():
        spec = P(mesh.axis_names if len(mesh.axis_names) > 1 else mesh.axis_names[0])
        sharding = NamedSharding(mesh, spec)
        rows = {d.id: i for i, d in enumerate(mesh.devices.flat)}

        def make(dtype, width, salt):
            # One row per device, filled from the device's position in the mesh.
            data = np.stack([common.make_input(dtype, width, rows[d.id], salt)
                             for d in mesh.local_devices])
            return jax.make_array_from_process_local_data(sharding, data, (ndev, width))

        def smap(fn, out_spec=spec, check_vma=True):
            return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=out_spec,
                                         check_vma=check_vma))

        for axes in axes_of[mesh_name]:
            tag = f"{mesh_name}/{axes}"
            x = make("float32", 1000, 1)
            xi = make("int32", 333, 2)
            for ours, theirs, name in [(herring_jax.psum, jax.lax.psum, "psum"),
                                       (herring_jax.pmean, jax.lax.pmean, "pmean")]:
                a = smap(lambda v: ours(v, axes))(x)
                b = smap(lambda v: theirs(v, axes))(x)
                common.report(f"{tag}/{name}/float32", same(a, b))
            a = smap(lambda v: herring_jax.psum(v, axes))(xi)
            b = smap(lambda v: jax.lax.psum(v, axes))(xi)
            common.report(f"{tag}/psum/int32", same(a, b, exact=True))
            # A pytree of mixed dtypes in one call.
            tree = {"a": x, "b": xi}
            a = smap(lambda t: herring_jax.psum(t, axes))(tree)
            b = smap(lambda t: jax.lax.psum(t, axes))(tree)
            common.report(f"{tag}/psum/tree", same(a["a"], b["a"]) and
                          same(a["b"], b["b"], exact=True))

            # Gradient of a loss through the reduction, with and without
            # shard_map's varying-axis checks (they transpose differently).
            for check_vma in (True, False):
                def loss(red):
                    def inner(v):
                        s = red(jnp.sin(v) * v, axes)
                        return (s * jnp.linspace(0.5, 1.5, s.shape[-1])).sum(-1, keepdims=True)
                    f = jax.shard_map(inner, mesh=mesh, in_specs=spec, out_specs=spec,
                                      check_vma=check_vma)
                    return lambda v: f(v).sum()
                ga = jax.jit(jax.grad(loss(herring_jax.psum)))(x)
                gb = jax.jit(jax.grad(loss(jax.lax.psum)))(x)
                common.report(f"{tag}/grad/check_vma={check_vma}", same(ga, gb))

            t = make("float32", 1000, 3)
            ja = jax.jit(lambda p, q: jax.jvp(smap(lambda v: herring_jax.psum(v * v, axes)),
                                               (p,), (q,)))(x, t)
            jb = jax.jit(lambda p, q: jax.jvp(smap(lambda v: jax.lax.psum(v * v, axes)),
                                               (p,), (q,)))(x, t)
            common.report(f"{tag}/jvp", same(ja[0], jb[0]) and same(ja[1], jb[1]))

            # vmap over an unnamed batch axis inside the shard_map body.
            va = smap(lambda v: jax.vmap(lambda r: herring_jax.psum(r, axes))(v.reshape(-1, 10))
                      .reshape(v.shape))(x)
            vb = smap(lambda v: jax.lax.psum(v, axes))(x)
            common.report(f"{tag}/vmap", same(va, vb))

        # Invariant result: psum over every axis, out_specs P() (check_vma on).
        x = make("float32", 64, 4)
        a = smap(lambda v: herring_jax.psum(v, mesh.axis_names), out_spec=P())(x)
        b = smap(lambda v: jax.lax.psum(v, mesh.axis_names), out_spec=P())(x)
        common.report(f"{mesh_name}/invariant-out", same(a, b))

    # jax.pmap over the local devices, the axis spanning every process.
    rows = np.stack([common.make_input("float32", 100, herring_jax.process_index() * local + d, 5)
                     for d in range(local)])
    for ours, theirs, name in [(herring_jax.psum, jax.lax.psum, "psum"),
                               (herring_jax.pmean, jax.lax.pmean, "pmean")]:
        a = np.asarray(jax.pmap(lambda v: ours(v, "i"), axis_name="i")(rows))
        b = np.asarray(jax.pmap(lambda v: theirs(v, "i"), axis_name="i")(rows))
        common.report(f"pmap/{name}", np.allclose(a, b, rtol=1e-5, atol=1e-5))

    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
