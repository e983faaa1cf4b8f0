"""herring_jax's lax drop-ins under jax.vmap, beside jax.lax's (jax's own
vmap forms with lax swapped for herring_jax), on 2 processes x 2 devices.

  vmap/<form>/out_axes=<a>: vmap(..., axis_name="i") of an all_gather over
    "i" (plain, tiled, of a constant): the gathered value is the same on
    every element of the vmapped axis, and lax's batching leaves it
    unbatched, so out_axes=None takes it; herring's gives the same values
    (and out_axes=0 the same as lax's too).
  vmap-of-shard_map/spmd_axis_name: a psum in a shard_map manual over every
    mesh axis, vmapped with spmd_axis_name: herring's sums as lax's.
  reduced/<form>: grad of a psum over "x" of a value reduced over "y" (the
    cotangent comes unreduced over "y"): value and gradient as lax's.
  jaxpr/<form>: jax's own jaxpr-level tests of psum's transposes (a fan-in
    psum transposes to one pvary; a psum with implicit fan-out to a
    psum_invariant and a pvary) and of a scan of a psum: the same equations,
    by str(primitive) (their .name is herring's: herring_psum_invariant).
  partial-manual/error: a psum in a shard_map that leaves a mesh axis to XLA.s
    partitioner (axis_names=): XLA would refuse to replicate herring's
    reduction when compiling; herring refuses when jit lowers, naming the
    axes and what to do.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # lax across processes

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

LIBS = {"lax": jax.lax, "herring": herring_jax}


def run_both(fn) -> dict:
    """lib name -> np result of fn(lib), or the error's text."""
    out = {}
    for name, lib in LIBS.items():
        try:
            out[name] = np.asarray(jax.device_get(fn(lib)))
        except Exception as e:  # noqa: BLE001 - reported as the case's failure
            out[name] = f"{type(e).__name__}: {e}"[:400]
    return out


def same(results: dict) -> bool:
    a, b = results["lax"], results["herring"]
    return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
            and bool(np.array_equal(a, b)))


def vmap_gathers() -> None:
    x = jnp.arange(12.).reshape(3, 4)
    forms = {
        "plain": lambda lib: lambda v: lib.all_gather(v, "i"),
        "tiled": lambda lib: lambda v: lib.all_gather(v, "i", tiled=True),
        "constant": lambda lib: lambda v: lib.all_gather(jnp.arange(2.), "i"),
        # A gathered value beside a batched one: each output keeps its own.
        "two-outputs": lambda lib: lambda v: (lib.all_gather(v, "i"), 2 * v)[0],
    }
    for form, make in forms.items():
        for out_axes in (None, 0):
            results = run_both(lambda lib: jax.jit(jax.vmap(
                make(lib), axis_name="i", out_axes=out_axes))(x))
            common.report(f"vmap/{form}/out_axes={out_axes}", same(results),
                          **{k: str(v)[:300] for k, v in results.items()})


def vmap_of_shard_map(mesh) -> None:
    x = jnp.arange(4 * 8.).reshape(4, 8)

    def fn(lib):
        g = jax.shard_map(lambda v: lib.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=P())
        y = jax.jit(jax.vmap(g, spmd_axis_name="y"))(x)
        return np.concatenate([np.asarray(s.data).ravel() for s in y.addressable_shards])

    results = run_both(fn)
    common.report("vmap-of-shard_map/spmd_axis_name", same(results),
                  **{k: str(v)[:300] for k, v in results.items()})


def partial_manual(mesh) -> None:
    x = jnp.arange(4 * 8.).reshape(4, 8)

    def fn(lib):
        g = jax.shard_map(lambda v: lib.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=P(), axis_names={"x"})
        return jax.jit(g)(x).addressable_shards[0].data

    results = run_both(fn)
    text = results["herring"]
    ok = (isinstance(results["lax"], np.ndarray) and isinstance(text, str)
          and text.startswith("NotImplementedError") and "['y']" in text
          and "axis_names=" in text and "jax.lax" in text)
    common.report("partial-manual/error", ok, **{k: str(v)[:400] for k, v in results.items()})


def reduced_psum_grads(devices) -> None:
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2,
                         devices=list(devices))
    forms = {"vector": (np.arange(4.), P("x"), P("x", reduced={"y"})),
             "scalar": (np.float32(2.), P(), P(reduced={"y"}))}
    for form, (value, spec, reduced) in forms.items():
        def fn(lib):
            with jax.set_mesh(mesh):
                x = jax.device_put(value, spec)

                @jax.shard_map(in_specs=reduced, out_specs=P(reduced={"y"}))
                def f(a):
                    return lib.psum(a, "x")

                def loss(a):
                    return f(jax.reshard(a, reduced)).sum()
                value_, grad = jax.jit(jax.value_and_grad(loss))(x)
                return np.concatenate([np.ravel(np.asarray(s.data)) for v in (value_, grad)
                                       for s in v.addressable_shards])

        results = run_both(fn)
        common.report(f"reduced/{form}", same(results),
                      **{k: str(v)[:300] for k, v in results.items()})


def jaxpr_forms(devices) -> None:
    mesh = jax.sharding.Mesh(devices, ("x",))
    x4, x1 = jnp.arange(4.), jnp.array([1.])

    def body_names(jaxpr, depth=1):
        e, = jaxpr.jaxpr.eqns
        eqns = e.params["jaxpr"].eqns
        for _ in range(depth - 1):
            e, = eqns
            eqns = e.params["jaxpr"].eqns
        return [str(q.primitive) for q in eqns]

    def fan_in(lib):
        f = jax.shard_map(lambda v: lib.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=P())
        return body_names(jax.make_jaxpr(jax.vjp(f, x4)[1])(x1))

    def fan_out(lib):
        f = jax.shard_map(lambda v: lib.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=P("x"))
        return body_names(jax.make_jaxpr(jax.vjp(f, x4)[1])(x4))

    def scan(lib):
        def f(v):
            def g(c, _):
                return jax.lax.pcast(lib.psum(c, "x"), "x", to="varying"), None
            return jax.lax.scan(g, v, None, length=2)[0]
        f = jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        return body_names(jax.make_jaxpr(f)(x4), depth=2)

    for form, fn in {"fan-in-transpose": fan_in, "implicit-fan-out-transpose": fan_out,
                     "scan": scan}.items():
        names = {}
        for lib_name, lib in LIBS.items():
            try:
                names[lib_name] = fn(lib)
            except Exception as e:  # noqa: BLE001 - reported as the case's failure
                names[lib_name] = f"{type(e).__name__}: {e}"[:300]
        common.report(f"jaxpr/{form}", names["herring"] == names["lax"]
                      and isinstance(names["lax"], list) and names["lax"], **names)


def main() -> int:
    herring_jax.initialize()
    by_proc = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    assert by_proc.size == 4, "runs on 4 devices in all"
    mesh = jax.sharding.Mesh(by_proc.reshape(2, 2), ("x", "y"))
    vmap_gathers()
    vmap_of_shard_map(mesh)
    partial_manual(mesh)
    reduced_psum_grads(by_proc)
    jaxpr_forms(by_proc)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
