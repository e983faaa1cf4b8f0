"""herring_jax.accordion: the switching against a numpy model of its rule,
the same decisions on every rank, a checkpoint that resumes the schedule,
branches that compress differently with error feedback moved at a switch
(2 processes, tests/workers/accordion_worker.py), and its argument checks."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from multiproc import assert_all_ok, launch


def test_accordion_switches_as_the_numpy_model_and_resumes_on_every_rank():
    run = launch("accordion_worker.py", ["--cases", "schedule1,schedule3,resume"], nproc=2)
    digests = assert_all_ok(run, expected_cases=3)
    # Every rank took the same branches and got the same results.
    assert all(len(d) == 1 for d in digests.values()), digests
    switches = {r["case"]: r.get("switches") for r in run.results[0]}
    assert switches["schedule1"] >= 8 and switches["schedule3"] >= 2, switches


def test_accordion_branches_compress_differently_and_hand_over_the_residual():
    # HERRING_HOST_STAGE=0: the codecs apply between the two processes.
    run = launch("accordion_worker.py", ["--cases", "codecs,powersgd,topk"], nproc=2,
                 env={"HERRING_HOST_STAGE": "0"})
    digests = assert_all_ok(run, expected_cases=3)
    assert all(len(d) == 1 for d in digests.values()), digests


def test_accordion_switches_alike_under_the_launch_identity():
    # XLA:CUDA's default identity names a reduction by its instruction and
    # the launches before it, which a skipped branch must not shift.
    run = launch("accordion_worker.py", ["--cases", "schedule1"], nproc=2,
                 env={"HERRING_IDENTITY": "launch"})
    digests = assert_all_ok(run, expected_cases=1)
    assert all(len(d) == 1 for d in digests.values()), digests


def test_the_rule_at_its_edges():
    from herring_jax._src.transforms.accordion import light_next, schedule_np
    f = np.float32
    assert light_next(f(0), f(3), 0.5)                     # nothing to compare with
    assert light_next(f(4), f(2), 0.5)                     # a change of exactly eta
    assert light_next(f(4), f(6), 0.5)
    assert not light_next(f(4), f(5), 0.5)
    assert not light_next(f(4), f(3.0001), 0.5)
    assert light_next(f(4), f(np.nan), 0.5)                # not finite: light
    assert schedule_np([f(4), f(4), f(9), f(9.5)], 0.5) == [True, True, False, True, False]
    # jax and numpy decide alike.
    assert bool(light_next(jnp.float32(4), jnp.float32(2), 0.5))
    assert not bool(light_next(jnp.float32(4), jnp.float32(5), 0.5))


def test_bad_arguments_are_named():
    import herring_jax
    light, heavy = herring_jax.allreduce_gradients(), herring_jax.allreduce_gradients(
        compression="int8")
    with pytest.raises(ValueError, match="eta must be a finite number > 0"):
        herring_jax.accordion(light, heavy, interval=10, eta=0)
    with pytest.raises(ValueError, match="eta must be a finite number > 0"):
        herring_jax.accordion(light, heavy, interval=10, eta=float("nan"))
    with pytest.raises(ValueError, match="interval must be a whole number of updates"):
        herring_jax.accordion(light, heavy, interval=0)
    with pytest.raises(ValueError, match="interval must be a whole number of updates"):
        herring_jax.accordion(light, heavy, interval=2.5)
    with pytest.raises(TypeError, match="light must be one of herring_jax's reducing"):
        herring_jax.accordion("powersgd", heavy, interval=10)
    params = {"w": jnp.zeros((4, 4))}
    with pytest.raises(TypeError, match="heavy's state is a .*, so heavy is not one of"):
        herring_jax.accordion(light, optax.sgd(0.1), interval=10).init(params)
    with pytest.raises(TypeError, match="light's state is a tuple"):
        herring_jax.accordion(optax.chain(light, optax.sgd(0.1)), heavy, interval=10).init(params)
    state = herring_jax.accordion(light, heavy, interval=10).init(params)
    assert bool(state.use_light) and int(state.light_steps) == 0
    assert state.accumulated["w"].shape == (4, 4)
