"""herring_jax.psum_scatter / all_gather / pmax / pmin against jax.lax's, on 4
devices in any process layout (1x4, 2x2, 4x1): the same functions with either
library, compared case by case; then the process-level collectives
(process_collectives_worker.py) on the processes of the layout.

Inputs are small integers (also as floats), so that lax's results (gloo across
processes) are exact and every value is compared bitwise; one case per mesh
takes floats that are not, bitwise against the numpy reference in herring's
documented order. Result types (dtype, shape, varying axes) are compared with
lax's through jax.eval_shape. Each case jits one program that holds several
calls, to keep the compile count (the cost of this suite) down.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# compat_worker sets gloo (lax across processes) and 64-bit types, as that suite.
from compat_worker import (DTYPES, GLOO_DTYPES, np_dtype, raises, same, same_type,  # noqa: E402
                           shards)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
import process_collectives_worker  # noqa: E402

LIBS = (herring_jax, jax.lax)
ROWS, COLS = 8, 12  # each device's block of the inputs


def exact(a, b) -> bool:
    """Bitwise the same trees (of global arrays: shard by shard)."""
    def equal(u, v):
        if isinstance(u, np.ndarray):
            return common.bitwise_equal(u, np.asarray(v))
        return same(u, v, exact=True)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def same_types(f, *args) -> bool:
    """f(herring_jax, ...) and f(jax.lax, ...) give the same result types."""
    return all(jax.tree.leaves(same_type(lambda *a: f(herring_jax, *a),
                                         lambda *a: f(jax.lax, *a), *args)))


def small_ints(shape, row, salt, dtype="float32"):
    """Small integers (exact in every dtype and in sums of 4), per device row."""
    n = int(np.prod(shape))
    return (common.make_input("int32", n, row, salt) % 23 - 11).astype(np_dtype(dtype)).reshape(
        shape)


def main() -> int:
    herring_jax.initialize()
    nproc = herring_jax.process_count()
    by_proc = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    assert by_proc.size == 4, "the suite runs on 4 devices in all"
    meshes = {"1d": jax.sharding.Mesh(by_proc, ("i",)),
              "2d": jax.sharding.Mesh(by_proc.reshape(2, 2), ("data", "model"))}
    # (mesh, axes, whether the check_vma=False, differentiation and vmap cases
    # run for it too)
    configs = [("1d", "i", True), ("2d", "data", False), ("2d", "model", False),
               ("2d", ("data", "model"), True), ("2d", ("model", "data"), False)]
    for mesh_name, axes, full in configs:
        mesh_cases(meshes[mesh_name], f"{mesh_name}/{axes}", axes, full)
    one_mesh_cases(meshes["1d"], nproc)
    if nproc > 1:
        process_collectives_worker.run_cases(herring_jax.process_index(), nproc)
    herring_jax.shutdown()
    return 0


class Mesh:
    """Inputs and shard_map for one mesh: one (ROWS, COLS) block per device,
    stacked along a leading dimension sharded over every mesh axis."""

    def __init__(self, mesh):
        self.mesh = mesh
        names = mesh.axis_names
        self.spec = P(names if len(names) > 1 else names[0])
        self.rows = {d.id: i for i, d in enumerate(mesh.devices.flat)}

    def make(self, salt, dtype="float32", fill=small_ints):
        data = np.stack([fill((ROWS, COLS), self.rows[d.id], salt, dtype)
                         for d in self.mesh.local_devices])
        return jax.make_array_from_process_local_data(NamedSharding(self.mesh, self.spec), data,
                                                      (4, ROWS, COLS))

    def smap(self, fn, check_vma=True, out_specs=None):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=self.spec,
                             out_specs=self.spec if out_specs is None else out_specs,
                             check_vma=check_vma)

    def group_size(self, axes):
        names = axes if isinstance(axes, tuple) else (axes,)
        return int(np.prod([self.mesh.shape[a] for a in names]))


def mesh_cases(mesh_np, tag, axes, full):
    m = Mesh(mesh_np)
    g = m.group_size(axes)
    x, k = m.make(1), m.make(2, "int32")

    # -- forward: every form of the calls in one program, with and without
    # shard_map's varying-axis checks; values and result types.
    def forward(lib, check_vma):
        def body(v, w):
            v, w = v[0], w[0]
            outs = {
                "ps_tiled_0": lib.psum_scatter(v, axes, tiled=True),
                "ps_tiled_1_int": lib.psum_scatter(w, axes, scatter_dimension=1, tiled=True),
                "ps_0": lib.psum_scatter(v[:g], axes),
                "ps_1": lib.psum_scatter(v[:, :g], axes, scatter_dimension=1),
                "ps_tree": lib.psum_scatter({"a": v, "b": w[:, :4]}, axes, tiled=True),
                "ps_invariant": lib.psum_scatter(jnp.arange(2.0 * g, dtype=jnp.float32), axes,
                                                 tiled=True),
                "ag_0": lib.all_gather(v[:2], axes),
                "ag_tiled_-1_int": lib.all_gather(w, axes, axis=-1, tiled=True),
                "ag_2": lib.all_gather(v[:2, :3], axes, axis=2),
                "ag_bool": lib.all_gather(w % 3 == 0, axes, axis=1),
                "ag_invariant": lib.all_gather(jnp.arange(3.0, dtype=jnp.float32), axes),
                "ag_to_invarying": lib.all_gather(v[:2], axes, axis=1, tiled=True,
                                                  to="invarying"),
                "pmax": lib.pmax(v, axes),
                "pmin_int": lib.pmin(w, axes),
                "pmax_bool": lib.pmax(w % 5 == 0, axes),
                "pmin_invariant": lib.pmin(jnp.float32(3.0), axes) * jnp.ones(1, jnp.float32),
            }
            return jax.tree.map(lambda r: r[None], outs)
        return m.smap(body, check_vma)

    for check_vma in (True, False) if full else (True,):
        fa, fb = (jax.jit(forward(lib, check_vma)) for lib in LIBS)
        common.report(f"{tag}/forward/check_vma={check_vma}",
                      exact(fa(x, k), fb(x, k))
                      and same_types(lambda lib, *a: forward(lib, check_vma)(*a), x, k))

    # Floats that are not small integers: bitwise the numpy reference, in
    # herring's order (processes in rank order, devices of a process first).
    xf = m.make(3, fill=lambda shape, row, salt, dtype: common.make_input(
        dtype, int(np.prod(shape)), row, salt).reshape(shape))
    out = jax.jit(m.smap(lambda v: herring_jax.psum_scatter(v[0], axes, tiled=True)[None]))(xf)
    common.report(f"{tag}/float-reference", all(
        common.bitwise_equal(got, want) for got, want in zip(shards(out), expected_blocks(
            m, axes, lambda row: common.make_input("float32", ROWS * COLS, row, 3).reshape(
                ROWS, COLS)))))

    if not full:
        return
    # -- differentiation: grad, vjp / linear_transpose and jvp through both
    # halves, in one program per library and check_vma.
    w1 = jnp.asarray(small_ints((4, ROWS // g, COLS), 0, 4))
    w2 = jnp.asarray(small_ints((4, ROWS, COLS * g), 0, 5))
    w3 = jnp.asarray(small_ints((4, g, ROWS, COLS), 0, 6))

    def derivatives(lib, check_vma, v, t):
        scatter = m.smap(lambda u: lib.psum_scatter(u[0] * u[0], axes, tiled=True)[None],
                         check_vma)
        gather = m.smap(lambda u: lib.all_gather(u[0] * u[0], axes, axis=1, tiled=True)[None],
                        check_vma)
        lin_scatter = m.smap(lambda u: lib.psum_scatter(u[0][:, :g] * 3.0, axes,
                                                        scatter_dimension=1)[None], check_vma)
        lin_gather = m.smap(lambda u: lib.all_gather(u[0] * 2.0, axes)[None], check_vma)
        invarying = m.smap(lambda u: lib.all_gather(u[0] * u[0], axes, to="invarying")[None],
                           check_vma)
        return {
            "grad_scatter": jax.grad(lambda u: (scatter(u) * w1).sum())(v),
            "grad_gather": jax.grad(lambda u: (gather(u) * w2).sum())(v),
            "grad_gather_invarying": jax.grad(lambda u: (invarying(u) * w3).sum())(v),
            "vjp_scatter": jax.vjp(lin_scatter, v)[1](lin_scatter(t))[0],
            "transpose_gather": jax.linear_transpose(lin_gather, v)(lin_gather(t))[0],
            "jvp_scatter": jax.jvp(scatter, (v,), (t,)),
            "jvp_gather": jax.jvp(gather, (v,), (t,)),
        }

    t = m.make(6)
    for check_vma in (True, False):
        da, db = (jax.jit(lambda v, u, lib=lib: derivatives(lib, check_vma, v, u))(x, t)
                  for lib in LIBS)
        common.report(f"{tag}/derivatives/check_vma={check_vma}", exact(da, db),
                      differ=[key for key in da if not exact(da[key], db[key])])

    # -- vmap: over an unnamed axis inside the body (batch dimension first and
    # not), and of the whole shard_map.
    def batched(lib, v, vb):
        inner = m.smap(lambda u: {
            "scatter_b0": jax.vmap(lambda r: lib.psum_scatter(r, axes, tiled=True))(
                u[0].reshape(2, ROWS // 2, COLS))[None],
            "scatter_b1": jax.vmap(lambda r: lib.psum_scatter(r, axes, tiled=True),
                                   in_axes=1)(u[0])[None],
            "gather_b1": jax.vmap(lambda r: lib.all_gather(r, axes), in_axes=1,
                                  out_axes=2)(u[0])[None],
            "pmax_b0": jax.vmap(lambda r: lib.pmax(r, axes))(u[0])[None],
        })(v)
        outer = jax.vmap(m.smap(lambda u: lib.psum_scatter(u[0], axes, scatter_dimension=1,
                                                           tiled=True)[None]))(vb)
        return inner, outer

    xb = jax.device_put(jnp.stack([x, x * 2.0]), NamedSharding(m.mesh, P(None, *m.spec)))
    va, vb = (jax.jit(lambda v, u, lib=lib: batched(lib, v, u))(x, xb) for lib in LIBS)
    common.report(f"{tag}/vmap", exact(va, vb))


def expected_blocks(m, axes, row_input):
    """Per local device (in device id order), its block of the float psum_scatter
    (tiled, dimension 0) in herring's order of summation."""
    names = list(m.mesh.axis_names)
    reduced = [names.index(a) for a in (axes if isinstance(axes, tuple) else (axes,))]
    shape = m.mesh.devices.shape
    out = {}
    for idx in np.ndindex(*shape):
        members = [j for j in np.ndindex(*shape)
                   if all(j[i] == idx[i] for i in range(len(shape)) if i not in reduced)]
        by_proc: dict[int, list] = {}
        for j in members:  # mesh order: within a process, its devices in order
            dev = m.mesh.devices[j]
            by_proc.setdefault(dev.process_index, []).append(row_input(m.rows[dev.id]))
        total = common.reference("float32", "sum", [by_proc[p] for p in sorted(by_proc)])
        block = int(np.ravel_multi_index([idx[i] for i in reduced], [shape[i] for i in reduced]))
        rows = ROWS // len(members)
        out[m.mesh.devices[idx].id] = total[block * rows:(block + 1) * rows][None]
    return [out[d.id] for d in sorted(m.mesh.local_devices, key=lambda d: d.id)]


def one_mesh_cases(mesh_np, nproc):
    m = Mesh(mesh_np)
    x = m.make(7, fill=lambda *a: small_ints(*a) + 11)  # >= 0: unsigned dtypes too

    # -- every dtype psum takes, in one program: psum_scatter and all_gather
    # against lax where gloo has the dtype, else numpy (small integers: exact).
    def dtypes(lib, check):
        def body(v):
            outs = {}
            for dt in DTYPES:
                u = v[0].astype(np_dtype(dt)) if dt != "bool" else v[0] > 0
                if np.issubdtype(np_dtype(dt), np.complexfloating):
                    u = u + 1j * u[::-1]
                if dt != "bool":
                    outs[f"ps/{dt}"] = lib.psum_scatter(u, "i", tiled=True)[None]
                outs[f"ag/{dt}"] = lib.all_gather(u[:2], "i", axis=1)[None]
                if dt not in ("complex64", "complex128"):
                    outs[f"pmax/{dt}"] = lib.pmax(u, "i")[None]
            return outs
        return jax.jit(m.smap(body, check))

    ours = dtypes(herring_jax, True)(x)
    theirs = dtypes(jax.lax, True)(x)
    everyone = [small_ints((ROWS, COLS), r, 7) + 11 for r in range(4)]
    bad = []
    for key, got in ours.items():
        kind, dt = key.split("/")
        if dt in GLOO_DTYPES:
            ok = same(got, theirs[key], exact=True)
        else:
            ok = all(common.bitwise_equal(s, w) for s, w in zip(
                shards(got), numpy_results(kind, dt, everyone, m)))
        if not ok or got.dtype != theirs[key].dtype or got.shape != theirs[key].shape:
            bad.append(key)
    common.report("dtypes", not bad, bad=bad)

    # -- a wire codec: psum_scatter's blocks are bitwise psum's (the same sums in
    # the same order, encoded alike).
    wide = jax.make_array_from_process_local_data(
        NamedSharding(m.mesh, m.spec),
        np.stack([common.make_input("float32", 1024, m.rows[d.id], 10)
                  for d in m.mesh.local_devices]), (4, 1024))
    scattered, summed = jax.jit(m.smap(lambda v: (
        herring_jax.psum_scatter(v[0], "i", tiled=True, codec="bf16")[None],
        herring_jax.psum(v[0], "i", codec="bf16")[None])))(wide)
    local = sorted(m.mesh.local_devices, key=lambda d: d.id)
    common.report("codec-bf16", all(
        common.bitwise_equal(part[0], whole[0][m.rows[d.id] * 256:(m.rows[d.id] + 1) * 256])
        for d, part, whole in zip(local, shards(scattered), shards(summed))))

    # -- axis_index_groups (lax allows them with check_vma for these), pmax too.
    for groups in ([[0, 1], [2, 3]], [[3, 0], [2, 1]]):
        for check_vma in (True, False):
            def grouped(lib, groups=groups, check_vma=check_vma):
                return jax.jit(m.smap(lambda v: {
                    "ps": lib.psum_scatter(v[0], "i", tiled=True, axis_index_groups=groups),
                    "ag": lib.all_gather(v[0][:2], "i", axis_index_groups=groups),
                    "pmax": lib.pmax(v[0], "i", axis_index_groups=groups),
                }, check_vma, out_specs={"ps": m.spec, "ag": m.spec, "pmax": m.spec}))
            a, b = grouped(herring_jax)(x), grouped(jax.lax)(x)
            common.report(f"axis_index_groups/{groups}/check_vma={check_vma}",
                          exact(a, b) and same_types(
                              lambda lib, v, f=grouped: f(lib)(v), x))

    # -- pmap over all 4 devices, whichever process holds them.
    local = 4 // nproc
    me = herring_jax.process_index()
    rows = np.stack([small_ints((4, 6), me * local + d, 8) for d in range(local)])

    def pmapped(lib):
        return jax.pmap(lambda v: (lib.psum_scatter(v, "i"), lib.all_gather(v, "i", axis=1),
                                   lib.pmin(v, "i"),
                                   lib.psum_scatter(v[:, :4], "i", scatter_dimension=1,
                                                    tiled=True)),
                        axis_name="i")
    a, b = pmapped(herring_jax)(rows), pmapped(jax.lax)(rows)
    common.report("pmap", all(np.array_equal(np.asarray(u), np.asarray(v))
                              for u, v in zip(a, b)))

    # -- vmap with an axis name and no mesh: done in place, as lax does
    # (batched and unbatched operands).
    xs = jnp.asarray(small_ints((4, 4, 6), 0, 9))
    c = jnp.asarray(small_ints((4, 6), 1, 9))

    def named(lib):
        return jax.vmap(lambda r: {
            "ps": lib.psum_scatter(r, "b"),
            "ps_tiled_1": lib.psum_scatter(r[:, :4], "b", scatter_dimension=1, tiled=True),
            "ps_const": lib.psum_scatter(c, "b"),
            "ag": lib.all_gather(r, "b", axis=1),
            "ag_tiled": lib.all_gather(r, "b", tiled=True),
            "ag_const": lib.all_gather(c, "b"),
            "pmax": lib.pmax(r, "b"),
        }, axis_name="b")(xs)
    common.report("vmap-named", exact(jax.tree.map(np.asarray, named(herring_jax)),
                                      jax.tree.map(np.asarray, named(jax.lax))))

    error_cases(m, x)


def numpy_results(kind, dt, everyone, m):
    """The local devices' results of the dtype case `kind` (small integers)."""
    to = np_dtype(dt)

    def cast(a):
        a = a > 0 if dt == "bool" else a.astype(to)
        return a + 1j * a[::-1] if np.issubdtype(to, np.complexfloating) else a
    vals = [cast(e) for e in everyone]
    out = []
    for d in sorted(m.mesh.local_devices, key=lambda d: d.id):
        r = m.rows[d.id]
        if kind == "ps":
            total = sum(v.astype(to) for v in vals).astype(to)
            out.append(total[r * 2:(r + 1) * 2][None])
        elif kind == "ag":
            out.append(np.stack([v[:2] for v in vals], axis=1)[None])
        else:
            out.append(np.maximum.reduce(vals)[None])
    return out


def error_cases(m, x):
    """lax's errors, and herring's where it differs (with its own message)."""
    smap = m.smap

    def both(exc, fn):
        ok_a, why_a = raises(exc, jax.jit(smap(lambda v: fn(herring_jax, v[0])[None])), x)
        ok_b, why_b = raises(exc, jax.jit(smap(lambda v: fn(jax.lax, v[0])[None])), x)
        return ok_a and ok_b, [why_a, why_b]

    checks = {
        "tiled-not-divisible": both(ValueError, lambda lib, v: lib.psum_scatter(
            v[:3], "i", tiled=True)),
        "untiled-size": both(ValueError, lambda lib, v: lib.psum_scatter(v[:3], "i")),
        "bool": both(TypeError, lambda lib, v: lib.psum_scatter(v > 0, "i", tiled=True)),
        "unbound-axis": both(NameError, lambda lib, v: lib.all_gather(v, "nope")),
        # jax's FSDP forms (reduced / unreduced types; tests/test_fsdp_recipe.py
        # runs them): what lax refuses of them, herring refuses too.
        "to-reduced-invariant": both(ValueError, lambda lib, v: lib.all_gather(
            jnp.ones(3), "i", to="reduced")),
        "to-reduced-groups": both(NotImplementedError, lambda lib, v: lib.all_gather(
            v, "i", to="reduced", axis_index_groups=[[0, 1], [2, 3]])),
        "unreduced-groups": both(NotImplementedError, lambda lib, v: lib.psum_scatter(
            jax.lax.pcast(v, "i", to="unreduced"), "i", tiled=True,
            axis_index_groups=[[0, 1], [2, 3]])),
        # numpy's AxisError from herring (an IndexError and a ValueError);
        # IndexError from jax 0.10's lax, ValueError from 0.12's.
        "scatter-dimension-out-of-range": both((IndexError, ValueError),
                                               lambda lib, v: lib.psum_scatter(
            v, "i", scatter_dimension=2, tiled=True)),
        "pmax-grad": (lambda r: (r[0], [r[1]]))(raises(
            NotImplementedError, jax.jit(jax.grad(lambda v: smap(
                lambda u: herring_jax.pmax(u, "i"))(v).sum())), x)),
        "lax-pmax-grad": (lambda r: (r[0], [r[1]]))(raises(
            NotImplementedError, jax.jit(jax.grad(lambda v: smap(
                lambda u: jax.lax.pmax(u, "i"))(v).sum())), x)),
    }
    # A negative scatter dimension: jax 0.10's lax traces it and fails to
    # lower it (herring refuses it while tracing); 0.12's counts it from the
    # end, as numpy (so does herring).
    negative = [raises(ValueError, jax.jit(smap(lambda v, lib=lib: lib.psum_scatter(
        v[0], "i", scatter_dimension=-1, tiled=True)[None])), x) for lib in LIBS]
    if negative[1][0]:
        checks["negative-scatter-dimension"] = (negative[0][0], [why for _, why in negative])
    else:
        got, want = (jax.jit(smap(lambda v, lib=lib, d=d: lib.psum_scatter(
            v[0], "i", scatter_dimension=d, tiled=True)[None]))(x)
            for lib, d in ((herring_jax, -1), (jax.lax, x.ndim - 2)))
        checks["negative-scatter-dimension"] = (exact(got, want), [why for _, why in negative])
    # A varying result with out_specs P(): shard_map refuses both alike.
    refused = [raises(ValueError, jax.jit(jax.shard_map(
        lambda v, lib=lib: lib.psum_scatter(v[0], "i", tiled=True), mesh=m.mesh,
        in_specs=m.spec, out_specs=P())), x) for lib in LIBS]
    checks["out_specs-P()"] = (all(ok for ok, _ in refused), [why for _, why in refused])
    # What herring refuses and lax does not (see psum_scatter.py's notes).
    ours = {
        "complex-pmax": (TypeError, lambda v: herring_jax.pmax(v.astype(jnp.complex64), "i")),
        "unequal-groups": (ValueError, lambda v: herring_jax.psum_scatter(
            v, "i", tiled=True, axis_index_groups=[[0], [1, 2, 3]])),
        "vmap-and-mesh-axes": (NotImplementedError, lambda v: jax.vmap(
            lambda r: herring_jax.psum_scatter(r, ("b", "i"), tiled=True), axis_name="b")(
                jnp.stack([v, v]))),
    }
    for name, (exc, fn) in ours.items():
        ok, why = raises(exc, jax.jit(smap(lambda v, fn=fn: fn(v[0])[None], check_vma=(
            name != "vmap-and-mesh-axes"))), x)
        checks[f"herring-{name}"] = (ok, [why])
    common.report("errors", all(ok for ok, _ in checks.values()),
                  failed={k: w for k, (ok, w) in checks.items() if not ok})


if __name__ == "__main__":
    sys.exit(main())
