"""JAX's shard_map FSDP recipe (docs/notebooks/shard_map.md, "fully sharded
data parallelism") with herring_jax's all_gather / pmean in place of lax's,
against lax's, on 4 devices in any process layout (1x4, 2x2); then jax's
newer FSDP forms (a gather to='reduced' whose cotangent is reduce-scattered
unreduced, a psum of unreduced values), the names remat policies see, and
the unbound-axis errors.

Every case runs the same function once with jax.lax and once with
herring_jax. Floating results are compared within 1e-5 relative to the
largest of lax's (herring sums in rank order, XLA in its own); the saved
residuals of the remat'd forward pass by their types, as print_saved_residuals
prints them.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # lax across processes

import jax.ad_checkpoint  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

LIBS = {"lax": jax.lax, "herring": herring_jax}
RTOL = 1e-5
SIZES = [784, 128, 128, 8]  # the recipe's layers
BATCH = 32

# The recipe's policy, as documented: whatever is not an all_gather is saved,
# so that the backward pass gathers again instead of keeping whole weights.
RECIPE_POLICY = lambda op, *_, **__: str(op) != 'all_gather'  # noqa: E731


def close(a, b) -> tuple[bool, float]:
    """Every leaf of b within RTOL of a's (relative to a's largest value)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.shape != y.shape:
            return False, float("inf")
        worst = max(worst, float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(x))), 1e-30))
    same_tree = jax.tree.structure(a) == jax.tree.structure(b)
    return same_tree and worst <= RTOL, worst


def local(tree):
    """This process's shards of global arrays, in device order."""
    return [np.asarray(s.data) for leaf in jax.tree.leaves(tree)
            for s in sorted(leaf.addressable_shards, key=lambda s: s.device.id)]


def raises(exc_type, fn, *args) -> tuple[bool, str]:
    try:
        fn(*args)
    except exc_type as e:
        return True, f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - any other type is a failure
        return False, f"{type(e).__name__}: {e}"
    return False, "no error"


# -- the recipe ----------------------------------------------------------------

def recipe(lib, axis, policy=RECIPE_POLICY, name=None):
    """(predict, loss) of the recipe with `lib`'s collectives over `axis`;
    `name`: checkpoint_name the gathered weights so."""

    @partial(jax.remat, policy=policy)
    def predict(params, inputs):
        for w_frag, b_frag in params:
            w = lib.all_gather(w_frag, axis, tiled=True)
            b = lib.all_gather(b_frag, axis, tiled=True)
            if name is not None:
                w = jax.ad_checkpoint.checkpoint_name(w, name)
            outputs = jnp.dot(inputs, w) + b
            inputs = jax.nn.relu(outputs)
        return outputs

    def loss(params, batch):
        inputs, targets = batch
        predictions = predict(params, inputs)
        return lib.pmean(jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1)), axis)

    return loss


def residual_types(loss, mesh, spec, params, batch) -> list[str]:
    """The types print_saved_residuals prints for the remat'd loss, inside
    shard_map (traced only: eval_shape runs nothing)."""
    out = io.StringIO()

    def show(p, b):
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(loss, p, b)
        return jnp.zeros(())

    jax.eval_shape(jax.shard_map(show, mesh=mesh, in_specs=(spec, spec), out_specs=P()),
                   params, batch)
    return sorted(line.split(" ", 1)[0] for line in out.getvalue().splitlines() if line)


def recipe_inputs(mesh, spec):
    keys = jax.random.split(jax.random.key(0), 3)
    params = []
    for k, n_in, n_out in zip(keys, SIZES[:-1], SIZES[1:]):
        k1, k2 = jax.random.split(k)
        params.append((jax.random.normal(k1, (n_in, n_out)) / np.sqrt(n_in),
                       jax.random.normal(k2, (n_out,))))
    batch = (jax.random.normal(keys[0], (BATCH, SIZES[0])),
             jax.random.normal(keys[1], (BATCH, SIZES[-1])))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return jax.tree.map(put, params), jax.tree.map(put, batch)


def recipe_cases(mesh, tag, axis) -> None:
    spec = P(axis)
    params, batch = recipe_inputs(mesh, spec)
    n = int(np.prod([mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,))]))
    # What lax's FSDP avoids saving: a whole weight (each device holds 1/n).
    whole = {f"f32[{a},{b}]" for a, b in zip(SIZES[:-1], SIZES[1:])}

    def saves_whole_weights(residuals) -> bool:
        return bool(whole & {r.split("{")[0] for r in residuals})

    def run(lib, policy=RECIPE_POLICY, name=None):
        loss = recipe(lib, axis, policy, name)
        f = jax.jit(jax.shard_map(jax.value_and_grad(loss), mesh=mesh, in_specs=(spec, spec),
                                  out_specs=(P(), spec)))
        value, grads = f(params, batch)
        return local(value), local(grads), residual_types(loss, mesh, spec, params, batch)

    # The recipe unchanged: the documented policy, lax's and herring's
    # gradients, and the saved residuals. lax.pmean divides lax.psum's result
    # by the axis size, and that division's divisor is saved (a scalar
    # literal); herring's pmean divides on the server, in the reduction.
    lax_loss, lax_grads, lax_res = run(jax.lax)
    her_loss, her_grads, her_res = run(herring_jax)
    ok_loss, err_loss = close(lax_loss, her_loss)
    ok_grads, err_grads = close(lax_grads, her_grads)
    missing = sorted(set(lax_res) - set(her_res))
    extra = sorted(set(her_res) - set(lax_res))
    only_divisor = (missing == ["f32[]"] and not extra
                    and [r for r in lax_res if r != "f32[]"] == her_res)
    common.report(f"recipe/{tag}", ok_loss and ok_grads and only_divisor
                  and not saves_whole_weights(her_res),
                  loss_error=err_loss, grad_error=err_grads, lax_residuals=lax_res,
                  herring_residuals=her_res)

    # Policies that name the gathered weights: saved when named so, not
    # saved when excluded, as lax's; and a policy that saves only what it
    # calls all_gather keeps herring's gathers (the whole weights) as lax's.
    policies = {
        "save_only_these_names": (jax.checkpoint_policies.save_only_these_names("gathered"),
                                  "gathered", True),
        "save_any_names_but_these": (
            jax.checkpoint_policies.save_any_names_but_these("gathered"), "gathered", False),
        "str_is_all_gather": (lambda prim, *_, **__: str(prim) == "all_gather", None, True),
    }
    for label, (policy, name, saves_whole) in policies.items():
        _, lax_grads, lax_res = run(jax.lax, policy, name)
        _, her_grads, her_res = run(herring_jax, policy, name)
        ok, err = close(lax_grads, her_grads)
        # As above, lax's pmean saves its divisor where the policy saves it.
        lax_res = [r for r in lax_res if r != "f32[]"] if "f32[]" not in her_res else lax_res
        common.report(f"policy/{label}/{tag}", ok and her_res == lax_res
                      and saves_whole_weights(her_res) == saves_whole and n > 1,
                      grad_error=err, lax_residuals=lax_res, herring_residuals=her_res)


# -- jax's newer FSDP forms (reduced / unreduced types) -------------------------

def explicit_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))


def newer_forms() -> dict:
    """name -> f(lib) returning (outputs, gradients, result types), each from
    jax's own shard_map tests of these forms with lax swapped for `lib`."""
    forms = {}

    def form(fn):
        forms[fn.__name__] = fn
        return fn

    def types(*xs):
        return [jax.typeof(x).str_short(True) for x in xs]

    @form
    def all_gather_reduced_fwd_unreduced_psum_scatter_bwd(lib):
        mesh = explicit_mesh((2, 2), ("data", "seq"))
        with jax.set_mesh(mesh):
            x = jax.device_put(np.arange(8.).reshape(4, 2), P("seq", None))
            y = jax.device_put(np.arange(12.).reshape(2, 6), P("seq", None))
            seen = []

            @jax.shard_map(in_specs=P("seq", None), out_specs=P(None, None, reduced={"seq"}))
            def ag(a):
                out = lib.all_gather(a, axis_name="seq", tiled=True, to="reduced")
                seen.extend(types(out))
                return out

            f = jax.jit(lambda x, y: jnp.einsum("td,df->tf", x, ag(y)).sum())
            return f(x, y), jax.jit(jax.grad(f, argnums=(0, 1)))(x, y), seen

    @form
    def unreduced_psum_scatter_fwd_all_gather_reduced_bwd(lib):
        mesh = explicit_mesh((4,), ("x",))
        with jax.set_mesh(mesh):
            x = jax.device_put(np.arange(16.).reshape(4, 4), P(None, "x"))
            y = jax.device_put(np.arange(24.).reshape(4, 6), P("x", None))
            seen = []

            @jax.shard_map(in_specs=P(unreduced={"x"}), out_specs=P("x", None))
            def rs(a):
                out = lib.psum_scatter(a, axis_name="x", tiled=True)
                seen.extend(types(out))
                return out

            def f(x, y):
                return rs(jnp.einsum("ab,bc->ac", x, y, out_sharding=P(unreduced={"x"}))).sum()
            return jax.jit(f)(x, y), jax.jit(jax.grad(f, argnums=(0, 1)))(x, y), seen

    def unreduced_reduction(lib, reduce):
        mesh = explicit_mesh((4,), ("x",))
        with jax.set_mesh(mesh):
            x = jax.device_put(np.arange(16.).reshape(4, 4), P(None, "x"))
            y = jax.device_put(np.arange(24.).reshape(4, 6), P("x", None))
            seen = []

            @jax.shard_map(in_specs=P(unreduced={"x"}), out_specs=P())
            def ar(a):
                out = getattr(lib, reduce)(a, "x")
                seen.extend(types(out))
                return out

            def f(x, y):
                return ar(jnp.einsum("ab,bc->ac", x, y, out_sharding=P(unreduced={"x"}))).sum()
            return jax.jit(f)(x, y), jax.jit(jax.grad(f, argnums=(0, 1)))(x, y), seen

    @form
    def unreduced_psum_fwd_preduced_bwd(lib):
        return unreduced_reduction(lib, "psum")

    @form
    def unreduced_pmean_fwd_preduced_bwd(lib):
        return unreduced_reduction(lib, "pmean")

    @form
    def unreduced_fsdp_grad(lib):
        mesh = explicit_mesh((2, 2), ("data", "seq"))
        with jax.set_mesh(mesh):
            x = jax.device_put(np.arange(64.).reshape(8, 4, 2), P("data", "seq", None))
            y = jax.device_put(np.arange(12.).reshape(2, 6), P("seq", None))
            seen = []

            @jax.shard_map(in_specs=P("seq", None), out_specs=P("seq", None, reduced={"data"}))
            def preduced(a):
                return jax.lax.pcast(a, axis_name="data", to="reduced")

            @jax.shard_map(in_specs=P("seq", None, reduced={"data"}),
                           out_specs=P(None, None, reduced={"seq", "data"}))
            def ag(a):
                out = lib.all_gather(a, axis_name="seq", tiled=True, to="reduced")
                seen.extend(types(out))
                return out

            def f(x, y):
                return jnp.sin(jnp.einsum("btd,df->btf", x, ag(preduced(y))).sum())
            return jax.jit(f)(x, y), jax.jit(jax.grad(f, argnums=(0, 1)))(x, y), seen

    @form
    def unreduced_fsdp_custom_vjp_bwd(lib):
        mesh = explicit_mesh((2, 2), ("data", "seq"))
        seen = []

        @jax.custom_vjp
        def f(x, y):
            @jax.shard_map(in_specs=P("seq", None), out_specs=P(None, None, reduced={"seq"}))
            def ag(a):
                return lib.all_gather(a, axis_name="seq", tiled=True, to="reduced")
            return jnp.einsum("btd,df->btf", x, ag(y))

        def f_fwd(x, y):
            return f(x, y), (x, y)

        def f_bwd(res, g):
            x, y = res

            @jax.shard_map(in_specs=P(unreduced={"data", "seq"}),
                           out_specs=P("seq", None, unreduced={"data"}))
            def rs(a):
                out = lib.psum_scatter(a, axis_name="seq", tiled=True)
                seen.extend(types(out))
                return out

            @jax.shard_map(in_specs=P("seq", None, unreduced={"data"}), out_specs=P("seq", None))
            def ar(a):
                out = lib.psum(a, axis_name="data")
                seen.extend(types(out))
                return out

            x_bar = jnp.einsum("btf,df->btd", g, y, out_sharding=P("data", "seq", None))
            y_bar = jnp.einsum("btd,btf->df", x, g,
                               out_sharding=P(None, None, unreduced={"data", "seq"}))
            return x_bar, ar(rs(y_bar))

        f.defvjp(f_fwd, f_bwd)
        with jax.set_mesh(mesh):
            x = jax.device_put(np.arange(64.).reshape(8, 4, 2), P("data", "seq", None))
            y = jax.device_put(np.arange(12.).reshape(2, 6), P("seq", None))
            loss = lambda x, y: jnp.sin(jax.jit(f)(x, y).sum())  # noqa: E731
            return jax.jit(loss)(x, y), jax.jit(jax.grad(loss, argnums=(0, 1)))(x, y), seen

    return forms


def newer_form_cases() -> None:
    for name, fn in newer_forms().items():
        try:
            lax_out, lax_grads, lax_types = fn(jax.lax)
            her_out, her_grads, her_types = fn(herring_jax)
        except Exception as e:  # noqa: BLE001 - reported as the case's failure
            common.report(f"newer/{name}", False, error=f"{type(e).__name__}: {e}"[:600])
            continue
        ok_out, err_out = close(local(lax_out), local(her_out))
        ok_grads, err_grads = close(local(lax_grads), local(her_grads))
        specs = [str(g.sharding.spec) for g in jax.tree.leaves(her_grads)]
        lax_specs = [str(g.sharding.spec) for g in jax.tree.leaves(lax_grads)]
        common.report(f"newer/{name}", ok_out and ok_grads and her_types == lax_types
                      and specs == lax_specs, out_error=err_out, grad_error=err_grads,
                      herring_types=her_types, lax_types=lax_types, grad_specs=specs)


# -- what remat policies and jaxpr readers see -----------------------------------

COLLECTIVES = {"psum", "psum_invariant", "pmax", "pmin", "reduce_scatter", "all_gather",
               "all_gather_invariant", "all_gather_reduced", "unreduced_psum",
               "unreduced_reduce_scatter"}


def primitive_names(mesh) -> None:
    """str() of each collective equation (what a policy's `str(prim)` tests)
    of every drop-in, with and without shard_map's varying-axis checks."""
    def calls(lib, check_vma):
        def body(v):
            v = v[0]
            outs = [lib.psum(v, "i"), lib.pmean(v, "i"), lib.pmax(v, "i"), lib.pmin(v, "i"),
                    lib.psum_scatter(v, "i", tiled=True), lib.all_gather(v, "i"),
                    lib.all_gather(v, "i", tiled=True, to="invarying")]
            outs = [jnp.sum(o)[None] for o in outs]
            if check_vma:
                reduced = jnp.sum(lib.all_gather(v, "i", to="reduced"))[None]
                outs.append(jax.lax.pcast(reduced, "i", to="varying"))
            return outs
        return jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                             check_vma=check_vma)

    x = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P("i")))
    for check_vma in (True, False):
        names = {}
        for lib_name, lib in LIBS.items():
            try:
                jaxpr = jax.make_jaxpr(calls(lib, check_vma))(x).jaxpr
            except Exception as e:  # noqa: BLE001 - reported as the case's failure
                names[lib_name] = f"{type(e).__name__}: {e}"[:300]
                continue
            [body] = [e.params["jaxpr"] for e in jaxpr.eqns if "jaxpr" in e.params]
            names[lib_name] = [str(e.primitive) for e in body.eqns
                               if str(e.primitive) in COLLECTIVES]
        common.report(f"primitive-names/check_vma={check_vma}",
                      names["herring"] == names["lax"] and len(names["lax"]) >= 7, **names)


# -- errors ----------------------------------------------------------------------

def unbound_axis(mesh) -> None:
    """herring's NameError starts with lax's own text, for an axis nothing
    binds and for a misspelt one. (Inside shard_map with check_vma, lax.psum,
    pmean, pmax and pmin of jax 0.10 meet a misspelt axis with a bare
    AssertionError; herring's text there starts with lax's outside it.)"""
    x = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("i")))
    bad = []
    for fn in ("psum", "pmean", "pmax", "pmin", "psum_scatter", "all_gather"):
        kw = {"tiled": True} if fn in ("psum_scatter", "all_gather") else {}
        texts = {}
        for where in ("outside", "misspelt"):
            for lib_name, lib in LIBS.items():
                f = getattr(lib, fn)
                call = lambda v: f(v, "nope", **kw)  # noqa: E731
                if where == "misspelt":
                    call = jax.shard_map(call, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
                raised, why = raises(NameError, jax.jit(call), x)
                texts[lib_name, where] = why.split(": ", 1)[1] if raised else None
        lax_text = texts["lax", "outside"]
        for where in ("outside", "misspelt"):
            herring_text = texts["herring", where] or ""
            if not (lax_text and "unbound axis name: nope" in lax_text
                    and herring_text.startswith(texts["lax", where] or lax_text)
                    and herring_text.startswith(lax_text)
                    and f"herring_jax.{fn}: unbound axis name(s) ['nope']" in herring_text):
                bad.append((fn, where, texts["lax", where], herring_text))
    common.report("errors/unbound-axis", not bad, bad=bad[:4])


def main() -> int:
    herring_jax.initialize()
    by_proc = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    assert by_proc.size == 4, "the suite runs on 4 devices in all"
    mesh_1d = jax.sharding.Mesh(by_proc, ("batch",))
    mesh_2d = jax.sharding.Mesh(by_proc.reshape(2, 2), ("data", "model"))
    recipe_cases(mesh_1d, "1d", "batch")
    recipe_cases(mesh_2d, "2d", ("data", "model"))
    newer_form_cases()
    primitive_names(jax.sharding.Mesh(by_proc, ("i",)))
    unbound_axis(jax.sharding.Mesh(by_proc, ("i",)))
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
