"""herring_jax's lax drop-ins under jax.vmap and with reduced operands as jax.lax's
(tests/workers/lax_vmap_worker.py): an all_gather over a vmapped axis is
unbatched (out_axes=None takes it), a psum in a vmapped shard_map sums as
lax's, a psum of a value reduced over another axis differentiates as lax's,
psum's transposes hold lax's equations, and a shard_map not manual over every mesh axis is refused when jit lowers,
naming what to do."""

from multiproc import assert_all_ok, launch

# 4 gather forms x 2 out_axes; the vmapped shard_map; the partial-manual
# error; 2 psums of reduced values under grad; 3 jaxpr-level forms.
CASES = 4 * 2 + 1 + 1 + 2 + 3


def test_lax_drop_ins_under_vmap_as_lax():
    run = launch("lax_vmap_worker.py", [], nproc=2, devices=2)
    assert_all_ok(run, expected_cases=CASES)
