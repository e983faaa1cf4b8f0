"""pytest timeouts follow the test mode: the long soak and chaos runs
(HERRING_LONG_TESTS=1) get the time they need, every other test keeps the
timeout of pyproject.toml."""

import os
import subprocess
import sys
import textwrap
import tomllib

from multiproc import ROOT

DEFAULT = float(tomllib.loads((ROOT / "pyproject.toml").read_text())
                ["tool"]["pytest"]["ini_options"]["timeout"])

# A plugin that prints, after collection, the timeout pytest-timeout will
# apply to each test: its closest `timeout` marker, else the ini value.
_PROBE = textwrap.dedent("""
    def pytest_collection_finish(session):
        for item in session.items:
            marker = item.get_closest_marker("timeout")
            value = marker.args[0] if marker else session.config.getini("timeout")
            print("TIMEOUT", item.nodeid, float(value))
""")


def _timeouts(tmp_path, long_tests: bool) -> dict[str, float]:
    (tmp_path / "timeout_probe.py").write_text(_PROBE)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("HERRING_LONG_TESTS", None)
    if long_tests:
        env["HERRING_LONG_TESTS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "--collect-only", "-q", "-p", "timeout_probe",
         "tests/test_soak.py", "tests/test_chaos.py", "tests/test_launch.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("TIMEOUT "):
            _, nodeid, value = line.split()
            found[nodeid] = float(value)
    return found


def test_long_mode_gives_soak_and_chaos_their_time(tmp_path):
    found = _timeouts(tmp_path, long_tests=True)
    soak = found["tests/test_soak.py::test_soak_every_result_bitwise_and_memory_flat"]
    kills = found["tests/test_chaos.py::test_killed_peer_fails_every_survivor_with_herring_error"]
    partitions = found[
        "tests/test_chaos.py::test_partitioned_host_fails_every_other_host_with_herring_error"]
    # The soak's launcher may run 7200 s: pytest must not stop it first.
    assert soak > 7200, found
    # 20 kills and 5 partitions, each allowed the survivors' 43 s deadlines.
    assert kills >= 20 * 3 * 43 and partitions >= 5 * 4 * 43, found
    others = {k: v for k, v in found.items() if k.startswith("tests/test_launch.py::")}
    assert others and set(others.values()) == {DEFAULT}, found


def test_short_mode_keeps_the_default(tmp_path):
    found = _timeouts(tmp_path, long_tests=False)
    assert len(found) > 3 and set(found.values()) == {DEFAULT}, found
