"""herring_jax.psum / pmean against jax.lax.psum / pmean, case by case, on 4
devices as 1 process x 4, 2 x 2 and 4 x 1: 1-D and 2-D meshes, tuples of axes,
shard_map with and without check_vma, pmap, vmap (unnamed, named, and of a
shard_map), jit and eager, grad / jvp / vjp / linear_transpose, every dtype,
axis_index_groups, unreduced and invariant inputs, lax's errors; and
herring_jax.allreduce against its documented (mpi4jax) convention. See
tests/workers/compat_worker.py."""

import json
import os
import subprocess
import sys

import pytest

from multiproc import assert_all_ok, launch

# Per reduced axis (6 over the three meshes): 8 psum/pmean checks, tree, 2
# grad, 2 vjp+transpose, jvp, vmap, named vmap, 2 vmap-of-shard_map,
# invariant input; per mesh: invariant output and unreduced input; then 15
# dtypes x 2, 4 axis_index_groups, 3 pmap, 1 named vmap, 1 errors, 2 allreduce.
EXPECTED = 6 * 19 + 3 * 2 + 30 + 4 + 3 + 1 + 1 + 2


@pytest.mark.parametrize("nproc,devices", [(1, 4), (2, 2), (4, 1)])
def test_lax_compatibility(nproc, devices):
    run = launch("compat_worker.py", [], nproc=nproc, devices=devices)
    assert_all_ok(run, expected_cases=EXPECTED)


def test_supported_jax_range_and_what_an_unknown_jax_is_told():
    from herring_jax._src.process import jax_compat
    import jax
    jax_compat.check_jax_version(jax.__version__)  # the jax under test is one it knows
    for version in ("0.10.0", "0.11.2", "0.12.0.1", "0.12.3.dev20261201"):
        jax_compat.check_jax_version(version)
    for version in ("0.9.2", "0.13.0", "1.0.0"):
        with pytest.raises(ImportError) as info:
            jax_compat.check_jax_version(version)
        message = str(info.value)
        assert f"supports jax >=0.10,<0.13, but found jax {version}" in message
        assert "pip install 'jax>=0.10,<0.13' 'jaxlib>=0.10,<0.13'" in message


def test_an_unknown_jax_fails_at_import_not_later():
    # The first public name loads jax_compat, which refuses before touching
    # any private jax name.
    code = ("import jax; jax.__version__ = '0.13.0'\n"
            "import herring_jax\n"
            "herring_jax.psum\n")
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ImportError: herring_jax supports jax >=0.10,<0.13, but found jax 0.13.0" in proc.stderr


def test_psum_types_follow_lax_unreduced_kind():
    """jax 0.11 and later type an unreduced value with the reduction it
    awaits (unreduced_kind): a psum's result has none left, and an operand
    that awaits a max is refused, as by lax.psum."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from herring_jax._src.process import jax_compat
    if not hasattr(jax.sharding, "UnreducedKind"):
        pytest.skip(f"jax {jax.__version__} has no unreduced_kind")
    mesh = jax.make_mesh((1,), ("i",))
    seen = {}

    def body(v):
        aval = jax.typeof(v)
        summed = aval.update(manual_axis_type=jax.sharding.ManualAxisType(unreduced={"i"}))
        seen["state"] = jax_compat.axis_state(summed, ("i",))
        seen["out"] = jax_compat.drop_reduced_axes(summed, ("i",)).mat
        maxed = aval.update(manual_axis_type=jax.sharding.ManualAxisType(
            unreduced={"i"}, unreduced_kind=jax.sharding.UnreducedKind.max))
        with pytest.raises(ValueError, match="cannot accept args with unreduced_kind="):
            jax_compat.axis_state(maxed, ("i",))
        return v

    x = jax.device_put(jnp.ones(2), NamedSharding(mesh, P("i")))
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x)
    assert seen["state"] == "unreduced"
    assert not seen["out"].unreduced and seen["out"].unreduced_kind is None, seen["out"]


def test_pyproject_asks_for_the_jax_jax_compat_knows():
    import tomllib
    from herring_jax._src.process import jax_compat
    from multiproc import ROOT
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = {f"jax{jax_compat.SUPPORTED_JAX}", f"jaxlib{jax_compat.SUPPORTED_JAX}"}
    assert wanted <= set(project["project"]["dependencies"])
    assert wanted <= set(project["build-system"]["requires"])


def test_no_collectives_forbids_herring_psum_as_it_forbids_lax_psum():
    """jax 0.12's jax.sharding.no_collectives: herring_jax.psum checks its
    axes through lax's own check, so it is refused with lax's error."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import herring_jax
    if not hasattr(jax.sharding, "no_collectives"):
        pytest.skip(f"jax {jax.__version__} has no no_collectives")
    mesh = jax.make_mesh((1,), ("i",))
    x = jax.device_put(jnp.ones(2), NamedSharding(mesh, P("i")))
    for psum, name in [(jax.lax.psum, "`psum`"), (herring_jax.psum, "`herring_jax.psum`")]:
        step = jax.jit(jax.shard_map(lambda v: psum(v, "i"), mesh=mesh, in_specs=P("i"),
                                     out_specs=P()))
        with jax.sharding.no_collectives({"i"}), pytest.raises(
                Exception, match=f"forbidden by `no_collectives`, but {name} acts on axis 'i'"):
            step(x)


# -- lax behaviours told apart by tracing lax, not by reading its source ------

# What lax does, per jax release herring_jax knows: whether all_gather(...,
# to='invarying') without check_vma is a plain all_gather (its transpose sums
# the cotangents), and whether psum_scatter counts a negative
# scatter_dimension from the end.
KNOWN_LAX = {(0, 10): (False, False), (0, 11): (False, True), (0, 12): (True, True)}


def _herring_and_lax_bind(gather_or_scatter: str):
    """The equations (name, collective, scatter_dimension) that lax and
    herring_jax bind for one call, inside a shard_map without check_vma."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import herring_jax

    def equations(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name != "shard_map":
                yield e.primitive.name, e.params.get("collective"), e.params.get(
                    "scatter_dimension")
            for v in e.params.values():
                inner = getattr(v, "jaxpr", v)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)

    mesh = jax.sharding.AbstractMesh((2,), ("i",))
    out = []
    for lib in (jax.lax, herring_jax):
        if gather_or_scatter == "gather":
            body = lambda v: lib.all_gather(v, "i", to="invarying")  # noqa: E731
        else:
            body = lambda v: lib.psum_scatter(v, "i", scatter_dimension=-1, tiled=True)  # noqa: E731
        f = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
        out.append(list(equations(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((4, 4), jnp.float32))
                                  .jaxpr)))
    return out


def test_lax_behaviours_are_those_of_the_jax_installed():
    import jax
    from herring_jax._src.process import jax_compat
    release = tuple(int(p) for p in jax.__version__.split(".")[:2])
    got = (jax_compat.invariant_gather_needs_check_vma(), jax_compat.negative_scatter_dimension())
    assert got == KNOWN_LAX[release], (jax.__version__, got)
    # And herring_jax follows lax on it.
    lax_eqns, herring_eqns = _herring_and_lax_bind("gather")
    # The gather is one equation (composite.py) named after lax's primitive
    # for it, holding the reduction, whose collective is that primitive too.
    [(lax_name, _, _)] = lax_eqns
    names = [n for n, _, _ in herring_eqns if n.startswith("herring")]
    assert names == [f"herring_{lax_name}", "herring_allreduce"], (lax_eqns, herring_eqns)
    herring_eqns = [(n, c) for n, c, _ in herring_eqns if n == "herring_allreduce"]
    assert [lax_name] == [herring_eqns[0][1]], (lax_eqns, herring_eqns)


# Run before herring_jax is imported: lax's all_gather and psum_scatter made
# to behave as jax 0.12's, written as a patch release might write them.
_REFORMATTED_LAX = '''
import numpy as np
from jax._src import config
from jax._src.lax import parallel

_gather, _scatter = parallel._all_gather_is_async, parallel._psum_scatter

def _all_gather_is_async(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False,
                         to="varying", is_async=False):
    if (to == "varying"
            or not config._check_vma.value):
        to = "varying"
    return _gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis, tiled=tiled,
                   to=to, is_async=is_async)

def _psum_scatter(x, axis_name, *, scatter_dimension, axis_index_groups, tiled, is_async):
    if scatter_dimension < 0:
        scatter_dimension = int(
            scatter_dimension) + np.ndim(x)
    return _scatter(x, axis_name, scatter_dimension=scatter_dimension,
                    axis_index_groups=axis_index_groups, tiled=tiled, is_async=is_async)

parallel._all_gather_is_async, parallel._psum_scatter = _all_gather_is_async, _psum_scatter
'''


def test_a_lax_laid_out_otherwise_is_told_by_what_it_does(tmp_path):
    """jax_compat once matched regular expressions over lax's source, and a
    release that laid the line out otherwise fell back silently to jax
    0.10's behaviour: herring_jax's all_gather(to='invarying') then kept an
    invariant gather where lax's is plain (wrong gradients), and refused a
    negative scatter_dimension that lax takes."""
    patch = tmp_path / "reformatted_lax.py"
    patch.write_text(_REFORMATTED_LAX)
    code = ("import sys, json; sys.path.insert(0, %r); import reformatted_lax\n"
            "sys.path.insert(0, %r); import test_compat\n"
            "print(json.dumps([test_compat._herring_and_lax_bind(k) "
            "for k in ('gather', 'scatter')]))\n") % (str(tmp_path), os.path.dirname(__file__))
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (lax_gather, herring_gather), (lax_scatter, herring_scatter) = json.loads(
        proc.stdout.splitlines()[-1])
    assert [n for n, _, _ in lax_gather] == ["all_gather"], lax_gather
    # (The drop-ins wrap the reduction in one equation of their own: composite.py.)
    assert [(n, c) for n, c, _ in herring_gather if n == "herring_allreduce"] == [
        ("herring_allreduce", "all_gather")], herring_gather
    assert lax_scatter == [["reduce_scatter", None, 1]], lax_scatter
    assert [(n, c) for n, c, _ in herring_scatter if n == "herring_allreduce"] == [
        ("herring_allreduce", "reduce_scatter")], herring_scatter


@pytest.fixture
def fresh_lax_answers():
    from herring_jax._src.process import jax_compat
    jax_compat.invariant_gather_needs_check_vma.cache_clear()
    jax_compat.negative_scatter_dimension.cache_clear()
    yield jax_compat
    jax_compat.invariant_gather_needs_check_vma.cache_clear()
    jax_compat.negative_scatter_dimension.cache_clear()


def test_a_lax_that_behaves_as_no_known_release_stops_herring(fresh_lax_answers, monkeypatch):
    import jax
    import jax.numpy as jnp
    from jax._src.lax import parallel
    from jax.sharding import PartitionSpec as P
    import herring_jax
    jax_compat = fresh_lax_answers
    # An all_gather that binds neither of the two known primitives, and a
    # psum_scatter that loses the scatter dimension.
    monkeypatch.setattr(parallel, "_all_gather_is_async",
                        lambda x, axis_name, **kw: jnp.stack([x, x]))
    scatter = parallel._psum_scatter
    monkeypatch.setattr(parallel, "_psum_scatter",
                        lambda x, a, *, scatter_dimension, **kw: scatter(x, a, scatter_dimension=0,
                                                                         **kw))
    with pytest.raises(RuntimeError, match=r"cannot tell how jax .*'s lax\.all_gather\(\.\.\., "
                       r"to='invarying'\) without check_vma behaves.*Rather than guess"):
        jax_compat.invariant_gather_needs_check_vma()
    with pytest.raises(RuntimeError, match=r"lax\.psum_scatter\(\.\.\., scatter_dimension=-1\) "
                       r"behaves: lax bound reduce_scatter with scatter_dimension \[0\]"):
        jax_compat.negative_scatter_dimension()
    # A user's call reaches the same error, not a guess.
    mesh = jax.sharding.AbstractMesh((2,), ("i",))
    f = jax.shard_map(lambda v: herring_jax.all_gather(v, "i", to="invarying"), mesh=mesh,
                      in_specs=P(), out_specs=P(), check_vma=False)
    with pytest.raises(RuntimeError, match="cannot tell how jax"):
        jax.make_jaxpr(f)(jax.ShapeDtypeStruct((4, 4), jnp.float32))
