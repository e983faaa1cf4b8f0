"""The lax.psum compatibility suite: the same function with jax.lax and with
herring_jax, compared case by case, on 4 devices in any process layout (1x4,
2x2, 4x1). Also herring_jax.allreduce against its documented (mpi4jax)
convention.

Values are compared with lax.psum's results (gloo across processes) where
gloo reduces the dtype, else with a numpy reference; result types (dtype,
shape, varying axes) with lax's, taken from jax.eval_shape. Integers must be
bitwise equal, floating values close (herring sums in rank order, XLA in its
own order).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # lax.psum across processes
jax.config.update("jax_enable_x64", True)  # 64-bit dtypes are part of the suite

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128"]
# What gloo reduces for lax.psum across processes; the rest get a numpy reference.
GLOO_DTYPES = {"int8", "uint8", "int32", "int64", "float16", "float32", "float64"}


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def shards(a):
    return [np.asarray(s.data) for s in sorted(a.addressable_shards, key=lambda s: s.device.id)]


def close(x, y, exact):
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if exact or x.dtype.kind in "biu":
        return np.array_equal(x, y)
    tol = 2e-2 if x.dtype in (np.float16, np_dtype("bfloat16")) else 1e-5
    return np.allclose(x.astype(np.complex128), y.astype(np.complex128), rtol=tol, atol=tol)


def same(a, b, exact=False):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], exact) for k in a)
    sa, sb = shards(a), shards(b)
    return len(sa) == len(sb) and all(close(x, y, exact) for x, y in zip(sa, sb))


def same_type(f, g, *args):
    """f and g give the same result types (dtype, shape, varying axes)."""
    ta, tb = jax.eval_shape(f, *args), jax.eval_shape(g, *args)
    return jax.tree.map(lambda a, b: (a.dtype, a.shape, str(a.sharding)) ==
                        (b.dtype, b.shape, str(b.sharding)), ta, tb)


def raises(exc_type, fn, *args):
    try:
        fn(*args)
    except exc_type as e:
        return True, f"{type(e).__name__}: {e}"[:200]
    except Exception as e:  # noqa: BLE001 - any other type is a failure
        return False, f"{type(e).__name__}: {e}"[:200]
    return False, "no error"


def main() -> int:
    herring_jax.initialize()
    nproc = herring_jax.process_count()
    me = herring_jax.process_index()
    by_proc = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    ndev = by_proc.size
    assert ndev == 4, "the suite runs on 4 devices in all"
    meshes = {
        "1d": jax.sharding.Mesh(by_proc, ("i",)),
        "2d": jax.sharding.Mesh(by_proc.reshape(2, 2), ("data", "model")),
        "2d-t": jax.sharding.Mesh(by_proc.reshape(2, 2).T, ("data", "model")),
    }
    axes_of = {"1d": ["i"], "2d": ["data", "model", ("data", "model")],
               "2d-t": ["model", ("model", "data")]}

    for mesh_name, mesh in meshes.items():
        spec = P(mesh.axis_names if len(mesh.axis_names) > 1 else mesh.axis_names[0])
        sharding = NamedSharding(mesh, spec)
        rows = {d.id: i for i, d in enumerate(mesh.devices.flat)}

        def make(dtype, width, salt, mesh=mesh, sharding=sharding, rows=rows):
            # One row per device, filled from the device's position in the mesh.
            data = np.stack([common.make_input(dtype, width, rows[d.id], salt)
                             for d in mesh.local_devices])
            return jax.make_array_from_process_local_data(sharding, data, (ndev, width))

        def smap(fn, out_spec=spec, check_vma=True, mesh=mesh, spec=spec):
            return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=out_spec,
                                         check_vma=check_vma))

        for axes in axes_of[mesh_name]:
            tag = f"{mesh_name}/{axes}"
            x = make("float32", 1000, 1)
            xi = make("int32", 333, 2)
            for check_vma in (True, False):
                for ours, theirs, name in [(herring_jax.psum, jax.lax.psum, "psum"),
                                           (herring_jax.pmean, jax.lax.pmean, "pmean")]:
                    for v, dt in [(x, "float32"), (xi, "int32")]:
                        f = smap(lambda t, ours=ours: ours(t, axes), check_vma=check_vma)
                        g = smap(lambda t, theirs=theirs: theirs(t, axes), check_vma=check_vma)
                        common.report(f"{tag}/{name}/{dt}/check_vma={check_vma}",
                                      same(f(v), g(v), exact=dt == "int32") and
                                      all(jax.tree.leaves(same_type(f, g, v))))
            # A pytree of mixed dtypes in one call.
            tree = {"a": x, "b": xi}
            a = smap(lambda t: herring_jax.psum(t, axes))(tree)
            b = smap(lambda t: jax.lax.psum(t, axes))(tree)
            common.report(f"{tag}/psum/tree", same(a["a"], b["a"]) and
                          same(a["b"], b["b"], exact=True))

            # grad, vjp and linear_transpose through the reduction, with and
            # without shard_map's varying-axis checks (they transpose differently).
            for check_vma in (True, False):
                def loss(red, check_vma=check_vma):
                    def inner(v):
                        s = red(jnp.sin(v) * v, axes)
                        return (s * jnp.linspace(0.5, 1.5, s.shape[-1])).sum(-1, keepdims=True)
                    f = jax.shard_map(inner, mesh=mesh, in_specs=spec, out_specs=spec,
                                      check_vma=check_vma)
                    return lambda v: f(v).sum()
                ga = jax.jit(jax.grad(loss(herring_jax.psum)))(x)
                gb = jax.jit(jax.grad(loss(jax.lax.psum)))(x)
                common.report(f"{tag}/grad/check_vma={check_vma}", same(ga, gb))
                lin = {lib: jax.shard_map(lambda v, lib=lib: lib.pmean(v * 3.0, axes),
                                          mesh=mesh, in_specs=spec, out_specs=spec,
                                          check_vma=check_vma)
                       for lib in (herring_jax, jax.lax)}
                va = jax.jit(lambda c: jax.vjp(lin[herring_jax], x)[1](c))(x)
                vb = jax.jit(lambda c: jax.vjp(lin[jax.lax], x)[1](c))(x)
                ta = jax.jit(lambda c: jax.linear_transpose(lin[herring_jax], x)(c))(x)
                tb = jax.jit(lambda c: jax.linear_transpose(lin[jax.lax], x)(c))(x)
                common.report(f"{tag}/vjp+transpose/check_vma={check_vma}",
                              same(va[0], vb[0]) and same(ta[0], tb[0]))

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

            # vmap with an axis name, reduced together with the mesh axes.
            names = ("b",) + (axes if isinstance(axes, tuple) else (axes,))
            fa = smap(lambda v: jax.vmap(lambda r: herring_jax.pmean(r, names), axis_name="b")(
                v.reshape(-1, 10)).reshape(v.shape), check_vma=False)
            fb = smap(lambda v: jax.vmap(lambda r: jax.lax.pmean(r, names), axis_name="b")(
                v.reshape(-1, 10)).reshape(v.shape), check_vma=False)
            common.report(f"{tag}/vmap-named+mesh", same(fa(x), fb(x)))

            # vmap of a shard_map that reduces.
            xb = jax.device_put(jnp.stack([x, x * 2.0]), NamedSharding(mesh, P(None, *spec)))
            for check_vma in (True, False):
                fa = jax.vmap(smap(lambda v: herring_jax.psum(v, axes), check_vma=check_vma))
                fb = jax.vmap(smap(lambda v: jax.lax.psum(v, axes), check_vma=check_vma))
                common.report(f"{tag}/vmap-of-shard_map/check_vma={check_vma}",
                              same(fa(xb), fb(xb)))

            # An input that is the same on every device (invariant): as lax,
            # counted once per device; and psum(1, axes), the group size.
            fa = smap(lambda v: v * herring_jax.psum(jnp.arange(1000.0), axes)
                      + herring_jax.psum(1, axes))
            fb = smap(lambda v: v * jax.lax.psum(jnp.arange(1000.0), axes)
                      + jax.lax.psum(1, axes))
            common.report(f"{tag}/invariant-input", same(fa(x), fb(x)))

        # Invariant result: psum over every axis, out_specs P() (check_vma on).
        x = make("float32", 64, 4)
        a = smap(lambda v: herring_jax.psum(v, mesh.axis_names), out_spec=P())(x)
        b = smap(lambda v: jax.lax.psum(v, mesh.axis_names), out_spec=P())(x)
        common.report(f"{mesh_name}/invariant-out", same(a, b))
        # An unreduced input (a partial sum per device) becomes invariant.
        a = smap(lambda v: herring_jax.psum(jax.lax.pcast(v, mesh.axis_names, to="unreduced"),
                                            mesh.axis_names), out_spec=P())(x)
        b = smap(lambda v: jax.lax.psum(jax.lax.pcast(v, mesh.axis_names, to="unreduced"),
                                        mesh.axis_names), out_spec=P())(x)
        common.report(f"{mesh_name}/unreduced-input", same(a, b))

    # -- every dtype lax reduces, on the 1-D mesh --------------------------------
    mesh, spec = meshes["1d"], P("i")
    rows = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    for dt in DTYPES:
        def inputs(dev_row, dt=dt):
            base = common.make_input("int32" if dt != "bool" else "int32", 40, dev_row, 7)
            if dt == "bool":
                return base % 2 == 0
            if np.issubdtype(np_dtype(dt), np.complexfloating):
                return (base + 1j * base[::-1]).astype(dt)
            return (base % 97).astype(np_dtype(dt))  # wraps nowhere; sums stay exact
        data = np.stack([inputs(rows[d.id]) for d in mesh.local_devices])
        v = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), data, (ndev, 40))
        everyone = [inputs(r) for r in range(ndev)]
        for name in ("psum", "pmean"):
            f = jax.jit(jax.shard_map(lambda t, name=name: getattr(herring_jax, name)(t, "i"),
                                      mesh=mesh, in_specs=spec, out_specs=spec))
            g = jax.shard_map(lambda t, name=name: getattr(jax.lax, name)(t, "i"),
                              mesh=mesh, in_specs=spec, out_specs=spec)
            out = f(v)
            if dt in GLOO_DTYPES:
                ok = same(out, jax.jit(g)(v))
            else:
                want_t = jax.eval_shape(g, v).dtype
                acc = sum(e.astype(np.int64 if dt == "bool" else e.dtype) for e in everyone)
                want = (acc / ndev if name == "pmean" else acc).astype(want_t)
                ok = all(close(s, want[None, :], exact=False) for s in shards(out))
            ok = ok and jax.eval_shape(f, v).dtype == jax.eval_shape(g, v).dtype
            common.report(f"dtype/{dt}/{name}", ok)

    # -- axis_index_groups: check_vma=False and pmap as lax; check_vma raises ----
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, spec),
        np.stack([common.make_input("int32", 16, rows[d.id], 8) for d in mesh.local_devices]),
        (ndev, 16))
    for groups in ([[0, 1], [2, 3]], [[0, 3], [1, 2]], [[0, 1, 2, 3]]):
        fa = jax.jit(jax.shard_map(lambda t: herring_jax.psum(t, "i", axis_index_groups=groups),
                                   mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
        fb = jax.jit(jax.shard_map(lambda t: jax.lax.psum(t, "i", axis_index_groups=groups),
                                   mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
        common.report(f"axis_index_groups/{groups}", same(fa(x), fb(x), exact=True))
    ok, why = raises(NotImplementedError, jax.jit(jax.shard_map(
        lambda t: herring_jax.psum(t, "i", axis_index_groups=[[0, 1], [2, 3]]),
        mesh=mesh, in_specs=spec, out_specs=spec)), x)
    common.report("axis_index_groups/check_vma-raises", ok, why=why)

    # -- pmap ------------------------------------------------------------------
    local = ndev // nproc
    prows = np.stack([common.make_input("float32", 100, me * local + d, 5) for d in range(local)])
    for ours, theirs, name in [(herring_jax.psum, jax.lax.psum, "psum"),
                               (herring_jax.pmean, jax.lax.pmean, "pmean")]:
        a = np.asarray(jax.pmap(lambda v: ours(v, "i"), axis_name="i")(prows))
        b = np.asarray(jax.pmap(lambda v: theirs(v, "i"), axis_name="i")(prows))
        common.report(f"pmap/{name}", np.allclose(a, b, rtol=1e-5, atol=1e-5))
    # The pmap axis spans all 4 devices, whichever process holds them.
    g = [[0, 1], [2, 3]]
    gi = np.arange(local * 3, dtype=np.int32).reshape(local, 3) + me
    a = np.asarray(jax.pmap(lambda v: herring_jax.psum(v, "i", axis_index_groups=g),
                            axis_name="i")(gi))
    b = np.asarray(jax.pmap(lambda v: jax.lax.psum(v, "i", axis_index_groups=g),
                            axis_name="i")(gi))
    common.report("pmap/axis_index_groups", np.array_equal(a, b))

    # -- vmap with an axis name, no mesh at all (no communication) ---------------
    xs = jnp.asarray(common.make_input("float32", 12, 0, 9).reshape(3, 4))
    common.report("vmap-named/eager", same_np(
        jax.vmap(lambda r: herring_jax.pmean(r, "b"), axis_name="b")(xs),
        jax.vmap(lambda r: jax.lax.pmean(r, "b"), axis_name="b")(xs)))

    # -- errors, as lax: NameError while tracing -------------------------------
    ok1, why1 = raises(NameError, jax.jit(lambda v: herring_jax.psum(v, "i")), jnp.ones(3))
    ok2, why2 = raises(NameError, jax.jit(jax.shard_map(lambda v: herring_jax.psum(v, "nope"),
                                                        mesh=mesh, in_specs=spec,
                                                        out_specs=spec)), x)
    common.report("errors/unbound-axis", ok1 and ok2, why=[why1, why2])

    # -- allreduce across processes: the documented (mpi4jax) convention ---------
    a = jnp.asarray(common.make_input("float32", 50, me, 10))
    total = sum(common.make_input("float32", 50, r, 10).astype(np.float64) for r in range(nproc))
    ct = jnp.linspace(0.5, 1.5, 50, dtype=jnp.float32)

    def sq(v):
        return herring_jax.allreduce(v * v)
    for mode, wrap in [("eager", lambda f: f), ("jit", jax.jit)]:
        checks = {
            "value": np.allclose(wrap(herring_jax.allreduce)(a), total, rtol=1e-5),
            # d/dv sum(allreduce(v*v) * ct) = 2 v ct: the transpose is the identity.
            "grad": np.allclose(wrap(jax.grad(lambda v: (sq(v) * ct).sum()))(a), 2 * a * ct,
                                rtol=1e-5),
            "jvp": np.allclose(wrap(lambda p, t: jax.jvp(sq, (p,), (t,))[1])(a, ct),
                               herring_jax.allreduce(2 * a * ct), rtol=1e-5),
            "vjp": np.allclose(wrap(lambda c: jax.vjp(herring_jax.allreduce, a)[1](c)[0])(ct),
                               ct),
            "transpose": np.allclose(wrap(lambda c: jax.linear_transpose(
                lambda v: herring_jax.allreduce(v, op="mean"), a)(c)[0])(ct), ct / nproc),
            "vmap": np.allclose(wrap(jax.vmap(herring_jax.allreduce))(jnp.stack([a, 2 * a])),
                                np.stack([total, 2 * total]), rtol=1e-5),
        }
        common.report(f"allreduce/{mode}", all(checks.values()),
                      failed=[k for k, v in checks.items() if not v])

    herring_jax.shutdown()
    return 0


def same_np(a, b):
    return np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    sys.exit(main())
