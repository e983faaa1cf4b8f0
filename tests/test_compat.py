"""herring_jax.psum / pmean against jax.lax.psum / pmean, case by case, on 4
devices as 1 process x 4, 2 x 2 and 4 x 1: 1-D and 2-D meshes, tuples of axes,
shard_map with and without check_vma, pmap, vmap (unnamed, named, and of a
shard_map), jit and eager, grad / jvp / vjp / linear_transpose, every dtype,
axis_index_groups, unreduced and invariant inputs, lax's errors; and
herring_jax.allreduce against its documented (mpi4jax) convention. See
tests/workers/compat_worker.py."""

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
