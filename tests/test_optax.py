"""allreduce_gradients: training matches lax.pmean; fusion packing round-trips."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from multiproc import assert_all_ok, launch


@pytest.mark.parametrize("nproc,hosts", [(2, None), (4, 2)])
def test_training_matches_lax_pmean_on_every_process(nproc, hosts):
    # 4 processes on 2 simulated hosts: the buckets, reduced in place on
    # XLA:CPU, cross the host stage and the hosts' transport.
    run = launch("train_worker.py", [], nproc=nproc, hosts=hosts)
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
    from herring_jax._src.transforms import fusion
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
    # Backward order (no dataflow order outside jit): leaves are visited last
    # first, and buckets come in the order they become ready (their last leaf).
    assert all(b.leaves == tuple(sorted(b.leaves, reverse=True)) for b in buckets)
    ready_at = [min(b.leaves) for b in buckets]
    assert ready_at == sorted(ready_at, reverse=True)
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


def test_buckets_follow_the_backward_pass_not_pytree_order():
    """Inside jit, leaves are bucketed in the order the traced backward pass
    produces their gradients: Dense_11 first, Dense_0 last, although pytree
    order (sorted keys) puts Dense_10 and Dense_11 before Dense_2."""
    from herring_jax._src.transforms import fusion
    from herring_jax._src.process import jax_compat
    names = [f"Dense_{i}" for i in range(12)]
    params = {n: {"kernel": jnp.ones((8, 8)) * 0.1, "bias": jnp.zeros(8)} for n in names}

    def loss(p, x):
        for n in names:  # forward in numeric order
            x = jnp.tanh(x @ p[n]["kernel"] + p[n]["bias"])
        return x.sum()

    seen = {}

    @jax.jit
    def grads(p, x):
        g = jax.grad(loss)(p, x)
        leaves, treedef = jax.tree_util.tree_flatten(g)
        ready = jax_compat.production_order(leaves)
        seen["buckets"] = fusion.plan(leaves, 1, 1, ready=ready)  # one leaf per bucket
        seen["paths"] = [jax.tree_util.keystr(k) for k, _ in
                         jax.tree_util.tree_flatten_with_path(g)[0]]
        return g

    grads(params, jnp.ones((4, 8)))
    order = [seen["paths"][b.leaves[0]] for b in seen["buckets"]]
    layers = []
    for path in order:
        layer = int(path.split("Dense_")[1].split("'")[0])
        if not layers or layers[-1] != layer:
            layers.append(layer)
    assert layers == list(reversed(range(12))), order


def test_default_buffers_in_a_job_with_servers_are_large_enough_for_them():
    from herring_jax._src.transforms import optax_transform as ot
    mib = 2**20
    leaves = lambda total_mib: [jax.ShapeDtypeStruct((total_mib * mib // 4,), jnp.float32)]  # noqa: E731
    # Without servers: a sixteenth, between 256 KiB and 25 MiB.
    assert ot.auto_fusion_bytes(leaves(10)) == 10 * mib // 16
    assert ot.auto_fusion_bytes(leaves(1000)) == 25 * mib
    # With servers: a quarter, at least the servers' smallest buffer, at most 64 MiB.
    assert ot.auto_fusion_bytes(leaves(10), servers=1, server_min_bytes=4 * mib) == 4 * mib
    assert ot.auto_fusion_bytes(leaves(160), servers=4, server_min_bytes=4 * mib) == 40 * mib
    assert ot.auto_fusion_bytes(leaves(1000), servers=4, server_min_bytes=4 * mib) == 64 * mib
    # Gradients below that smallest buffer could never use the servers: the
    # default of a job without them (buffers small enough to overlap).
    assert (ot.auto_fusion_bytes(leaves(3), servers=4, server_min_bytes=4 * mib)
            == ot.auto_fusion_bytes(leaves(3)) == 256 * 1024)
    # Outside a job (no initialize()), plan_buckets takes no servers.
    assert ot.runtime.job_servers() == (0, 0)
