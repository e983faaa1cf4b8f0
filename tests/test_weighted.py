"""Weighted means (any-batch training): allreduce / pmean weight=,
allreduce_gradients and sharded_optimizer weight=True, bitwise against the
numpy model in rank order; bad weights refused."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import herring_jax
from multiproc import assert_all_ok, launch

ONE_DEVICE = (
    [f"eager/{d}/{c}" for d in ("float32", "bfloat16", "float16", "float64") for c in (1, 7, 4097)]
    + ["eager/complex64/9", "jit/float32/4097", "codec-bf16/float32/4097",
       "zero-weight-ignores-nan", "zero-total-is-zeros", "negative-weight-nan-in-jit",
       "negative-weight-raises-eagerly"]
    + [f"allreduce_gradients/none/step{t}" for t in range(3)]
    + ["allreduce_gradients/bf16/step0", "sharded_optimizer-matches-chain"])


def test_weighted_means_match_the_numpy_model_on_two_processes():
    run = launch("weighted_worker.py", [], nproc=2)
    digests = assert_all_ok(run, expected_cases=len(ONE_DEVICE))
    assert [r["case"] for r in run.results[0]] == ONE_DEVICE
    # The weights changed the result: the plain mean's bits are other ones.
    for r in run.results[0]:
        if r["case"].startswith("eager/") and r["case"].endswith("/4097"):
            assert r["differs_from_mean"], r
    zero = next(r for r in run.results[0] if r["case"] == "zero-weight-ignores-nan")
    assert zero["finite"], zero
    # Every process got the same bits.
    assert all(len(v) == 1 for v in digests.values()), digests


def test_weighted_means_match_the_numpy_model_on_two_processes_of_two_devices():
    run = launch("weighted_worker.py", ["--devices", "2"], nproc=2, devices=2)
    cases = [f"{f}/{d}/2dev" for d in ("float32", "bfloat16") for f in ("pmean", "allreduce")]
    assert_all_ok(run, expected_cases=len(cases) + 1)
    assert [r["case"] for r in run.results[0]] == cases + ["allreduce_gradients/2dev"]


# Bad input is refused before anything is reduced (no job needed).

def test_a_weight_with_another_op_than_mean_is_refused():
    with pytest.raises(ValueError, match="weight= needs op='mean'.*op='sum'"):
        herring_jax.allreduce(np.ones(3, np.float32), op="sum", weight=2.0)


def test_a_weight_that_is_not_a_scalar_is_refused():
    with pytest.raises(ValueError, match=r"weight must be a scalar.*shape \(2,\)"):
        herring_jax.allreduce(np.ones(3, np.float32), op="mean", weight=np.ones(2))
    with pytest.raises(TypeError, match="weight must be a real number.*complex64"):
        herring_jax.allreduce(np.ones(3, np.float32), op="mean", weight=np.complex64(1))


def test_allreduce_gradients_says_when_the_weight_is_missing_or_unexpected():
    g = {"w": jnp.ones(3)}
    weighted = herring_jax.allreduce_gradients(weight=True)
    with pytest.raises(TypeError, match=r"needs this step's weight.*weight=w"):
        weighted.update(g, weighted.init(g))
    plain = herring_jax.allreduce_gradients()
    # optax.chain hands every extra argument on: an unweighted transformation
    # must not drop the weight without a word.
    chain = optax.chain(plain, optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"built unweighted.*weight=True"):
        chain.update(g, chain.init(g), g, weight=3.0)
    with pytest.raises(ValueError, match="needs average=True"):
        herring_jax.allreduce_gradients(average=False, weight=True)
    with pytest.raises(TypeError, match="weight must be True"):
        herring_jax.allreduce_gradients(weight=3.0)
    with pytest.raises(ValueError, match="weight must be a scalar"):
        weighted.update(g, weighted.init(g), weight=jnp.ones(4))


def test_fully_sharded_refuses_a_weight_and_says_what_does_it():
    with pytest.raises(ValueError, match="fully_sharded does not take weight=.*"
                                         "sharded_optimizer\\(inner, weight=True\\)"):
        herring_jax.fully_sharded(optax.sgd(0.1), weight=True)


@pytest.mark.parametrize("make", [
    lambda: herring_jax.powersgd(2), lambda: herring_jax.topk(0.1),
    lambda: herring_jax.local_sgd(optax.sgd(0.1), 4, optax.sgd(1.0))])
def test_transformations_without_weights_refuse_the_one_a_chain_hands_them(make):
    # As optax.chain calls it with every extra argument (its state is never
    # reached: the refusal comes first, so no job is needed).
    g = {"w": jnp.ones((4, 4))}
    with pytest.raises(TypeError, match=r"does not take a weight.*"
                                        r"allreduce_gradients\(weight=True\)"):
        make().update(g, None, g, weight=3.0)
