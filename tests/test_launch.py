"""herring-jax launch: environment, output prefixes, failure, timeout and signal handling.

Every test runs a real launcher (`python -m herring_jax.launch`, or the Python
API in a fresh interpreter) on real `python -c` children, from tests/ so that
the installed herring_jax is the one under test.
"""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

# Writes this process's pid (and, with SPAWN, a grandchild's) to DIR/<rank>,
# atomically, so a reader never sees half a file.
_RECORD_PIDS = textwrap.dedent("""
    import os, subprocess, sys, time
    rank = os.environ["HERRING_PROCESS_ID"]
    pids = [os.getpid()]
    if SPAWN:
        pids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid)
    with open(os.path.join(DIR, rank + ".tmp"), "w") as f:
        f.write(" ".join(map(str, pids)))
    os.replace(os.path.join(DIR, rank + ".tmp"), os.path.join(DIR, rank))
""")


# Not the repository root: its herring_jax has no compiled extension and must
# not shadow the installed package.
_CWD = os.path.dirname(os.path.abspath(__file__))


def _launch_cmd(args):
    return [sys.executable, "-m", "herring_jax.launch", *args]


def _env(extra=None):
    return {**os.environ, "HERRING_LAUNCH_GRACE_S": "2", **(extra or {})}


def launch(args, env=None, timeout=60):
    """Runs the launcher to completion; returns the CompletedProcess."""
    return subprocess.run(_launch_cmd(args), env=_env(env), capture_output=True, text=True,
                          timeout=timeout, cwd=_CWD, check=False)


def _child(tmp_path, body, spawn=False):
    """A `python -c` program: record pids in tmp_path, then run body."""
    return (f"DIR = {str(tmp_path)!r}\nSPAWN = {spawn!r}\n" + _RECORD_PIDS
            + textwrap.dedent(body))


def _recorded_pids(tmp_path, n):
    return [int(p) for r in range(n) for p in (tmp_path / str(r)).read_text().split()]


def _gone(pid, within=5.0):
    """True once pid no longer runs (a zombie awaiting its reaper counts as gone)."""
    end = time.monotonic() + within
    while True:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                alive = f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            return True
        if not alive or time.monotonic() > end:
            return not alive
        time.sleep(0.05)


def test_environment_and_prefixes():
    # stdout: the environment; stderr: a line, bad UTF-8, and a last line with no newline.
    code = ("import os, sys; e = os.environ; print(e['HERRING_PROCESS_ID'],"
            " e['HERRING_NUM_PROCESSES'], e['HERRING_COORDINATOR_ADDRESS'],"
            " e['HERRING_LOCAL_RANK'], e['PYTHONUNBUFFERED']);"
            " sys.stderr.write('oops\\n'); sys.stderr.buffer.write(b'bad \\xff\\n');"
            " sys.stderr.write('no newline at the end')")
    p = launch(["-n", "3", "--", sys.executable, "-c", code])
    assert p.returncode == 0, p.stderr
    lines = sorted(p.stdout.splitlines())
    assert len(lines) == 3
    for rank, line in enumerate(lines):
        prefix, rest = line.split("] ", 1)
        assert prefix == f"[rank {rank}"
        pid, n, address, local_rank, unbuffered = rest.split()
        assert (pid, n, local_rank, unbuffered) == (str(rank), "3", str(rank), "1")
        assert address.startswith("127.0.0.1:") and int(address.split(":")[1]) > 0
    assert len({line.split()[4] for line in lines}) == 1  # one coordinator for all
    # stderr stays stderr, prefixed, whole lines only.
    assert sorted(p.stderr.splitlines()) == sorted(
        f"[rank {r}] {text}" for r in range(3)
        for text in ("oops", "bad \ufffd", "no newline at the end"))


def test_devices_per_process_replaces_the_xla_flag():
    code = "import os; print(os.environ['XLA_FLAGS']); print(os.environ['JAX_PLATFORMS'])"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo=1"}
    env_without = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    p = subprocess.run(_launch_cmd(["-n", "1", "--devices-per-process", "2", "--",
                                    sys.executable, "-c", code]),
                       env=dict(env_without, **env), capture_output=True, text=True, timeout=60,
                       cwd=_CWD, check=False)
    assert p.returncode == 0, p.stderr
    flags, platforms = [line.split("] ", 1)[1] for line in p.stdout.splitlines()]
    assert flags.count("--xla_force_host_platform_device_count") == 1
    assert "--xla_force_host_platform_device_count=2" in flags.split()
    assert "--foo=1" in flags.split()
    assert platforms == "cpu"


# A child's body (_child): rank 1 exits with 3 once all three ranks have
# recorded their pids; the others sleep.
_RANK_1_FAILS_ONCE_ALL_HAVE_STARTED = """
        if rank == "1":
            while len([f for f in os.listdir(DIR) if not f.endswith(".tmp")]) < 3:
                time.sleep(0.05)
            sys.exit(3)
        time.sleep(60)
    """


def test_a_failing_rank_stops_the_others_and_what_they_started(tmp_path):
    body = _RANK_1_FAILS_ONCE_ALL_HAVE_STARTED
    start = time.monotonic()
    p = launch(["-n", "3", "--", sys.executable, "-c", _child(tmp_path, body, spawn=True)])
    assert p.returncode == 3, p.stderr
    assert time.monotonic() - start < 30
    assert "herring-jax launch: rank 1 exited with code 3; stopping the other 2 processes" \
        in p.stderr
    pids = _recorded_pids(tmp_path, 3)
    assert len(pids) == 6
    for pid in pids[::2]:  # the ranks themselves were reaped by the launcher
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert all(_gone(pid) for pid in pids[1::2])  # grandchildren, in the same groups


def test_a_signal_death_gives_128_plus_the_signal():
    p = launch(["-n", "2", "--", sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    assert p.returncode == 137
    assert "exited with code 137 (killed by SIGKILL)" in p.stderr


def test_timeout_stops_everything_with_124():
    start = time.monotonic()
    p = launch(["-n", "2", "--timeout", "1", "--", sys.executable, "-c",
                "import time; time.sleep(60)"])
    assert p.returncode == 124
    assert time.monotonic() - start < 20
    assert "timed out after 1 s" in p.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_to_the_launcher_stops_every_process(tmp_path, sig):
    proc = subprocess.Popen(
        _launch_cmd(["-n", "2", "--", sys.executable, "-c",
                     _child(tmp_path, "time.sleep(60)", spawn=True)]),
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_CWD)
    try:
        end = time.monotonic() + 30
        while not all((tmp_path / str(r)).exists() for r in range(2)):
            assert time.monotonic() < end and proc.poll() is None, proc.poll()
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert f"got {sig.name}; stopping all 2 processes" in err
    assert all(_gone(pid) for pid in _recorded_pids(tmp_path, 2))


def _ours(pid, marker):
    """True if pid still runs a process whose command line holds marker."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker.encode() in f.read()
    except OSError:
        return False


def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    # SIGKILL leaves the launcher no chance to stop its ranks, which lead
    # their own sessions: only their parent-death signal can end them.
    proc = subprocess.Popen(
        _launch_cmd(["-n", "2", "--", sys.executable, "-c",
                     _child(tmp_path, "time.sleep(120)")]),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=_CWD)
    try:
        end = time.monotonic() + 30
        while not all((tmp_path / str(r)).exists() for r in range(2)):
            assert time.monotonic() < end and proc.poll() is None, proc.poll()
            time.sleep(0.05)
        pids = _recorded_pids(tmp_path, 2)
    finally:
        proc.kill()
        proc.wait()
    try:
        assert all(_gone(pid, within=10) for pid in pids), [
            open(f"/proc/{p}/stat").read() for p in pids if not _gone(p, within=0)]
    finally:
        for pid in pids:  # no orphan outlives a failed test either
            if _ours(pid, str(tmp_path)):
                os.kill(pid, signal.SIGKILL)


def test_missing_command_is_a_usage_error():
    p = launch(["-n", "2"])
    assert p.returncode == 2
    assert "usage:" in p.stderr and "no command given" in p.stderr and "'--'" in p.stderr


@pytest.mark.parametrize("via_cli", [True, False])
def test_a_misspelt_option_is_refused_with_the_subcommands_usage(via_cli):
    # Prefix matching would take --max-restart for --max-restarts.
    prog = ([sys.executable, "-c", "from herring_jax._src.cli import main; "
             "raise SystemExit(main())", "launch"] if via_cli
            else [sys.executable, "-m", "herring_jax.launch"])
    p = subprocess.run([*prog, "-n", "2", "--max-restart", "2", "--", "true"], env=_env(),
                       capture_output=True, text=True, timeout=60, cwd=_CWD)
    assert p.returncode == 2, p.stderr
    assert "unrecognized arguments: --max-restart" in p.stderr, p.stderr
    usage = "usage: herring-jax launch" if via_cli else "usage: python -m herring_jax.launch"
    assert p.stderr.startswith(usage), p.stderr


# child_env, argument errors and the `herring-jax` CLI, checked in one fresh
# interpreter (the repository root's herring_jax must not be the one imported).
_API_CHECKS = textwrap.dedent("""
    import contextlib, io, sys
    from herring_jax._src import cli
    from herring_jax._src.launcher import launch

    base = {"XLA_FLAGS": "--a=1 --xla_force_host_platform_device_count=8 --b=2",
            "JAX_PLATFORMS": "cuda", "OTHER": "x"}
    env = launch.child_env(base, rank=1, num_processes=4, port=1234, devices_per_process=3)
    assert env["XLA_FLAGS"] == "--a=1 --b=2 --xla_force_host_platform_device_count=3", env
    assert env["JAX_PLATFORMS"] == "cuda" and env["OTHER"] == "x", env
    assert env["HERRING_COORDINATOR_ADDRESS"] == "127.0.0.1:1234", env
    assert (env["HERRING_PROCESS_ID"], env["HERRING_NUM_PROCESSES"]) == ("1", "4"), env
    assert base["XLA_FLAGS"].endswith("--b=2"), base  # the input is left alone
    plain = launch.child_env({}, rank=0, num_processes=1, port=1)
    assert "XLA_FLAGS" not in plain and "JAX_PLATFORMS" not in plain, plain
    only = launch.child_env({}, 0, 1, 1, 2)
    assert only["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2", only

    for entry, args, message in [
        (launch.main, ["-n", "0", "--", "true"], "must be at least 1, got 0"),
        (launch.main, ["-n", "two", "--", "true"], "expected an integer, got 'two'"),
        (launch.main, ["-n", "1", "--timeout", "0", "--", "true"], "must be greater than 0"),
        (launch.main, ["--", "true"], "required: -n/--num-processes"),
        (cli.main, ["launch", "-n", "2"], "herring-jax launch: error: no command given"),
        (cli.main, [], "herring-jax: error:"),
    ]:
        err, code = io.StringIO(), None
        with contextlib.redirect_stderr(err):
            try:
                entry(args)
            except SystemExit as e:
                code = e.code
        assert code == 2, (args, code)
        assert message in err.getvalue(), (args, message, err.getvalue())

    sys.exit(cli.main(["launch", "-n", "2", "--", sys.executable, "-c",
                       "import os; print('hello from', os.environ['HERRING_PROCESS_ID'])"]))
""")


def test_python_api_argument_errors_and_cli():
    p = subprocess.run([sys.executable, "-c", _API_CHECKS], capture_output=True, text=True,
                       timeout=60, cwd=_CWD, check=False)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.splitlines()) == ["[rank 0] hello from 0", "[rank 1] hello from 1"]


def test_a_free_port_is_chosen_below_the_ephemeral_range():
    # Outgoing connections (gRPC clients, the transport, other jobs) take
    # their local ports from the ephemeral range, so a coordinator port chosen
    # there can be taken before rank 0 binds it; one below it cannot.
    import socket

    from herring_jax._src.process import ports

    lo, _ = ports.ephemeral_range()
    assert 1024 < lo <= 65535
    chosen = {ports.free_port() for _ in range(20)}
    assert all(10000 <= p < lo for p in chosen), (chosen, lo)
    assert len(chosen) > 1, "a random choice, so that jobs side by side differ"
    with socket.socket() as s:  # free: it can be bound
        s.bind(("127.0.0.1", chosen.pop()))


def test_ranks_other_than_0_wait_for_the_coordinators_port():
    # herring_jax.initialize() on ranks > 0 waits until process 0's
    # coordination service listens before it calls jax.distributed (whose
    # client would otherwise sleep out gRPC's one-second reconnect backoff).
    import socket
    import threading

    from herring_jax._src.process.joining import wait_for_coordinator

    with socket.socket() as probe:  # a free port, closed again at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    listening = threading.Event()
    server = socket.socket()

    def listen_later():
        time.sleep(0.5)
        server.bind(("127.0.0.1", port))
        server.listen()
        listening.set()

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        wait_for_coordinator(f"127.0.0.1:{port}", timeout_s=60)
        assert listening.is_set(), "returned before anything listened on the port"
    finally:
        thread.join()
        server.close()
    # Nothing listening: it gives up after its timeout, without raising, and
    # leaves the error to jax.distributed.
    wait_for_coordinator(f"127.0.0.1:{port}", timeout_s=0.2)


def test_a_coordinator_port_in_use_is_refused():
    # jax's coordination service would join another job's coordinator there,
    # and both jobs would fail.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = launch(["-n", "2", "--coordinator-port", str(port), "--", sys.executable, "-c",
                    "print('ran')"])
    assert p.returncode == 2, p.stderr
    assert f"--coordinator-port {port} is in use" in p.stderr
    assert "ran" not in p.stdout


def test_the_grace_wait_is_announced_and_skipped_for_a_rank_ignoring_sigterm(tmp_path):
    # Rank 1 fails; rank 0 catches SIGTERM and runs on (rank 0's handler only
    # records it): the launcher says how long it waits before SIGKILL. Rank 2
    # ignores SIGTERM outright: it gets no grace at all.
    body = """
        import signal
        if rank == "0":
            signal.signal(signal.SIGTERM, lambda *a: None)
        if rank == "2":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    """ + _RANK_1_FAILS_ONCE_ALL_HAVE_STARTED
    start = time.monotonic()
    p = launch(["-n", "3", "--", sys.executable, "-c", _child(tmp_path, body)],
               env={"HERRING_LAUNCH_GRACE_S": "4"})
    took = time.monotonic() - start
    assert p.returncode == 3, p.stderr
    assert "waiting up to 4 s (HERRING_LAUNCH_GRACE_S) for 1 process to exit after SIGTERM" \
        in p.stderr, p.stderr
    assert took < 20, p.stderr
