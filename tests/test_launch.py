"""herring-jax launch: environment, output prefixes, failure handling."""

import os
import subprocess
import sys
import time

import pytest


def launch(args, env=None, timeout=60):
    full = dict(os.environ, HERRING_LAUNCH_GRACE_S="2", **(env or {}))
    return subprocess.run([sys.executable, "-m", "herring_jax.launch", *args], env=full,
                          capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(__file__))


def test_environment_and_prefixes():
    code = ("import os; print(os.environ['HERRING_PROCESS_ID'], os.environ['HERRING_NUM_PROCESSES'],"
            " os.environ['HERRING_COORDINATOR_ADDRESS'])")
    p = launch(["-n", "3", "--", sys.executable, "-c", code])
    assert p.returncode == 0, p.stderr
    lines = sorted(p.stdout.splitlines())
    assert [l.split()[1] for l in lines] == ["0]", "1]", "2]"]
    fields = [l.split("] ", 1)[1].split() for l in lines]
    assert [f[0] for f in fields] == ["0", "1", "2"] and {f[1] for f in fields} == {"3"}
    assert len({f[2] for f in fields}) == 1 and fields[0][2].startswith("127.0.0.1:")


def test_stderr_is_prefixed_and_stays_stderr():
    p = launch(["-n", "2", "--", sys.executable, "-c", "import sys; sys.stderr.write('oops\\n')"])
    assert p.returncode == 0
    assert sorted(p.stderr.splitlines()) == ["[rank 0] oops", "[rank 1] oops"]
    assert p.stdout == ""


def test_devices_per_process_replaces_the_xla_flag():
    code = "import os; print(os.environ['XLA_FLAGS'], os.environ['JAX_PLATFORMS'])"
    p = launch(["-n", "1", "--devices-per-process", "2", "--", sys.executable, "-c", code],
               env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo=1",
                    "JAX_PLATFORMS": ""})
    assert p.returncode == 0, p.stderr
    out = p.stdout.strip()
    assert out.count("--xla_force_host_platform_device_count") == 1
    assert "--xla_force_host_platform_device_count=2" in out and "--foo=1" in out


def test_a_failing_rank_stops_the_others(tmp_path):
    code = (f"import os, sys, time; open(os.path.join({str(tmp_path)!r}, os.environ"
            "['HERRING_PROCESS_ID']), 'w').write(str(os.getpid()));"
            "rank = int(os.environ['HERRING_PROCESS_ID']);"
            "time.sleep(0.5); sys.exit(3) if rank == 1 else time.sleep(60)")
    start = time.monotonic()
    p = launch(["-n", "3", "--", sys.executable, "-c", code])
    assert p.returncode == 3
    assert time.monotonic() - start < 30
    assert "rank 1 exited with code 3" in p.stderr
    for rank in range(3):
        pid = int((tmp_path / str(rank)).read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_signal_death_and_timeout():
    p = launch(["-n", "2", "--", sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    assert p.returncode == 137
    start = time.monotonic()
    p = launch(["-n", "2", "--timeout", "1", "--", sys.executable, "-c",
                "import time; time.sleep(60)"])
    assert p.returncode == 124 and time.monotonic() - start < 20
    assert "timed out" in p.stderr


def test_missing_command_is_an_error():
    p = launch(["-n", "2"])
    assert p.returncode == 2 and "no command" in p.stderr
    p = launch(["-n", "0", "--", "true"])
    assert p.returncode == 2 and "at least 1" in p.stderr
