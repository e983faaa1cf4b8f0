"""herring_jax.psum / pmean against jax.lax.psum / pmean, case by case, on 4
devices as 1 process x 4, 2 x 2 and 4 x 1: 1-D and 2-D meshes, tuples of axes,
shard_map with and without check_vma, pmap, vmap (unnamed, named, and of a
shard_map), jit and eager, grad / jvp / vjp / linear_transpose, every dtype,
axis_index_groups, unreduced and invariant inputs, lax's errors; and
herring_jax.allreduce against its documented (mpi4jax) convention. See
tests/workers/compat_worker.py."""

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
    from herring_jax._src import jax_compat
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
    from herring_jax._src import jax_compat
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
    from herring_jax._src import jax_compat
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
