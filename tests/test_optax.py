"""allreduce_gradients: training matches lax.pmean; fusion packing round-trips."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from multiproc import assert_all_ok, launch


def test_training_matches_lax_pmean_on_every_process():
    run = launch("train_worker.py", [], nproc=2)
    digests = assert_all_ok(run, expected_cases=2)
    # Every process ends with the same parameters.
    assert len(digests["horovod-style"]) == 1
    for rs in run.results.values():
        hv = next(r for r in rs if r["case"] == "horovod-style")
        assert hv["final_loss"] < hv["first_loss"], hv


def _random_tree(rng, n_leaves):
    dtypes = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32]
    leaves = {}
    for i in range(n_leaves):
        shape = tuple(int(s) for s in rng.integers(0, 5, size=rng.integers(0, 4)))
        dtype = dtypes[rng.integers(len(dtypes))]
        leaves[f"l{i:03d}"] = jnp.asarray(rng.normal(size=shape) * 100).astype(dtype)
    return {"a": leaves, "b": [jnp.ones((2, 3)), (jnp.zeros(0),)]}


@pytest.mark.parametrize("seed,n_leaves,fusion_bytes", [
    (0, 1, 4), (1, 10, 16), (2, 300, 64), (3, 300, 1 << 20), (4, 50, 1)])
def test_fusion_round_trip(seed, n_leaves, fusion_bytes):
    from herring_jax._src import fusion
    tree = _random_tree(np.random.default_rng(seed), n_leaves)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    buckets = fusion.plan(leaves, fusion_bytes)
    # Every non-empty leaf in exactly one bucket, buckets single-dtype and
    # within the limit unless holding one oversized leaf.
    placed = [i for b in buckets for i in b.leaves]
    assert sorted(placed) == [i for i, x in enumerate(leaves) if x.size > 0]
    for b in buckets:
        assert all(np.dtype(leaves[i].dtype) == b.dtype for i in b.leaves)
        nbytes = sum(b.sizes) * b.dtype.itemsize
        assert nbytes <= fusion_bytes or len(b.leaves) == 1
    # Backward order: the first bucket starts with the last non-empty leaf.
    assert buckets[0].leaves[0] == max(placed)
    out = jax.tree_util.tree_unflatten(
        treedef, fusion.unpack(fusion.pack(leaves, buckets), buckets, leaves))
    for x, y in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(out)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_allreduce_gradients_is_an_optax_transformation():
    import herring_jax
    tx = herring_jax.allreduce_gradients()
    assert isinstance(tx, optax.GradientTransformation)
    assert isinstance(jax.jit(tx.init)({"w": jnp.ones(3)}), herring_jax.AllReduceGradientsState)
    with pytest.raises(ValueError, match="fusion_bytes"):
        herring_jax.allreduce_gradients(fusion_bytes=0)
