"""herring_jax.psum / pmean equal jax.lax.psum / pmean on 2 processes x 2
devices: 1-D and 2-D meshes, tuples of axes, grad, jvp, vmap, pytrees, pmap."""

from multiproc import assert_all_ok, launch

# Per mesh: 8 checks per reduced axis (or tuple) plus the invariant output;
# then psum and pmean under jax.pmap.
EXPECTED = (1 * 8 + 1) + 2 * (3 * 8 + 1) + 2


def test_psum_pmean_match_lax():
    run = launch("psum_worker.py", [], nproc=2, devices=2)
    assert_all_ok(run, expected_cases=EXPECTED)
