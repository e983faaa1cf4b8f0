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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "long_timeout(seconds): with HERRING_LONG_TESTS=1 this test's pytest "
        "timeout is `seconds` instead of the global one")


def pytest_collection_modifyitems(config, items):
    if not LONG_TESTS:
        return
    for item in items:
        marker = item.get_closest_marker("long_timeout")
        if marker is not None:
            # First, so that it wins over any timeout marker the test has.
            item.add_marker(pytest.mark.timeout(marker.args[0]), append=False)
