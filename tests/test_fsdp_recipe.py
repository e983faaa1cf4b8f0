"""JAX's shard_map FSDP recipe with herring_jax's collectives in place of
lax's (tests/workers/fsdp_recipe_worker.py), on 4 devices as 1 process x 4
and 2 x 2: the documented remat policy unchanged, loss and gradients within
1e-5 of lax's, the same saved residuals (only shards), checkpoint policies
that name collectives; jax's newer FSDP forms (gathers to='reduced',
unreduced cotangents, psum of unreduced values) as jax's own shard_map tests
run them; the primitive names policies see; lax's unbound-axis wording."""

import pytest

from multiproc import assert_all_ok, launch

# Per mesh (1-D, 2-D): the recipe and 3 policies; 6 newer forms; primitive
# names with and without check_vma; the unbound-axis errors.
CASES = 2 * (1 + 3) + 6 + 2 + 1


@pytest.mark.parametrize("nproc,devices", [(1, 4), (2, 2)])
def test_shard_map_fsdp_recipe_runs_with_herring_as_with_lax(nproc, devices):
    run = launch("fsdp_recipe_worker.py", [], nproc=nproc, devices=devices)
    assert_all_ok(run, expected_cases=CASES)
