"""pytest set-up: tests run against the installed herring_jax (see tests/run.sh)."""

import os

import pytest

# One CPU device per test process unless a test asks for more; the workers
# get their device count from the launcher.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# HERRING_LONG_TESTS=1 turns the soak and chaos tests into their long runs
# (docs/development.md), which take far longer than the 300 s pytest timeout that
# pyproject.toml gives every test.
LONG_TESTS = os.environ.get("HERRING_LONG_TESTS") == "1"

# The extended part of the suite: the tools (bench, train-bench, the GPU
# kit's dry run, the latency tool), the long-haul runs (soak, chaos, resume
# after a kill), and the largest layouts of tests whose other layouts stay in
# the main part (4 processes of one device each, the sharded chain on 2x2
# simulated hosts). `bash tests/run.sh` runs everything else;
# `bash tests/run.sh -m extended` runs these, as .ci/run does after it, and
# `bash tests/run.sh -m ""` both.
EXTENDED = {"test_bench.py", "test_train_bench.py", "test_tools.py", "test_gpu_check.py",
            "test_soak.py", "test_chaos.py", "test_resume.py"}
EXTENDED_CASES = {
    "test_allreduce.py::test_every_dtype_op_and_size[4-1]",
    "test_compat.py::test_lax_compatibility[4-1]",
    "test_collectives.py::test_lax_compatibility_and_process_collectives[4-1]",
    "test_sharded.py::test_the_parameters_match_the_unsharded_chain_on_every_process[4-2]",
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "long_timeout(seconds): with HERRING_LONG_TESTS=1 this test's pytest "
        "timeout is `seconds` instead of the global one")
    config.addinivalue_line(
        "markers", "extended: the suite's extended part (conftest.EXTENDED), which "
        "`bash tests/run.sh` leaves to `bash tests/run.sh -m extended`")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in EXTENDED or f"{item.path.name}::{item.name}" in EXTENDED_CASES:
            item.add_marker(pytest.mark.extended)
    if not LONG_TESTS:
        return
    for item in items:
        marker = item.get_closest_marker("long_timeout")
        if marker is not None:
            # First, so that it wins over any timeout marker the test has.
            item.add_marker(pytest.mark.timeout(marker.args[0]), append=False)
