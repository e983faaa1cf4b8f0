"""What a user meets in the second hour of using herring_jax
(tests/workers/second_hour_worker.py): errors that name the transformation
they called and the leaf at fault, and the sharded optimizer's check of its
inner transformation on one process as on several."""

import pytest

from multiproc import assert_all_ok, launch

WORKER = "second_hour_worker.py"


def test_gradient_transformations_name_themselves_and_the_leaf():
    # An integer gradient leaf: before, "the array has integer dtype int32"
    # from inside the fusion buffers, with no leaf and no function named. A
    # misspelt axis: before, "herring_jax.pmean: unbound axis name(s)".
    run = launch(WORKER, ["transforms"], nproc=2, devices=1, timeout=240)
    assert_all_ok(run, expected_cases=8)


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_inner_transformation_is_checked_on_one_process_as_on_several(nproc):
    # sharded_optimizer(optax.lamb) initialised on one process without a
    # word, and failed only once the script ran on two.
    run = launch(WORKER, ["lamb"], nproc=nproc, timeout=240)
    assert_all_ok(run, expected_cases=1)
