"""HERRING_DEVICE_LOCAL_SUM: a psum over several devices of each process
summed on the devices first (XLA's reduce-scatter and all-gather around
herring's start and done on 1/D of each buffer), run through XLA:CUDA's
handler code on the CPU double, 2 processes x 2 devices, against numpy
(tests/workers/local_sum_worker.py says what each case checks)."""

from multiproc import assert_all_ok, launch


def test_a_process_devices_sum_first_and_copy_half_each_bitwise_like_numpy():
    run = launch("local_sum_worker.py", [], nproc=2, devices=2, timeout=300,
                 env={"HERRING_TEST_DEVICE_DOUBLE": "1", "HERRING_DEVICE_LOCAL_SUM": "1"})
    digests = assert_all_ok(run, expected_cases=8 * 3 + 4)
    # Every process got the same bits.
    assert all(len(d) == 1 for c, d in digests.items() if c.startswith("psum-")), digests
