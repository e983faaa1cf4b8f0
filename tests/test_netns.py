"""The simulated cloud network (herring_jax/_src/launcher/netns.py) and `launch --netns`.

These need root and iproute2, which CI has: they fail, never skip, without.
Throughput is not asserted here (2 shared cores); BENCHMARKS.md has the
measurements. What is asserted: the topology and shaping as configured, that a
job runs across the namespaces, and that nothing is left behind, also after
an error, a Ctrl-C or a SIGKILLed creator.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from herring_jax._src.launcher import netns
from herring_jax._src.launcher.netns import SimulatedNetwork


# On one xdist worker, one after another: the killed-creator test leaves an
# orphan on purpose until its next network removes it, which another of these
# tests' fixture, running beside it, would take for its own.
pytestmark = pytest.mark.xdist_group("test_netns")


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    # orphans(), not leftovers(): a network that a test beside this one (another
    # xdist worker) holds while this one runs is not this test's.
    before = set(netns.orphans())
    yield
    assert set(netns.orphans()) <= before, "namespaces left behind"


def _in(net, host, *cmd):
    return subprocess.run(net.wrap(host, list(cmd)), capture_output=True, text=True,
                          timeout=60)


def test_rates_are_parsed_and_checked():
    assert netns.parse_rate("1gbit") == 1e9
    assert netns.parse_rate("250mbit") == 250e6
    assert netns.parse_rate("125mbps") == 1e9
    for bad in ("fast", "10", "-1gbit", "0mbit", "1 gigabit"):
        with pytest.raises(ValueError, match="not a rate"):
            netns.parse_rate(bad)
    with pytest.raises(ValueError, match="exceeds the host rate"):
        SimulatedNetwork(2, "100mbit", "1gbit")
    with pytest.raises(ValueError, match="needs a host rate"):
        SimulatedNetwork(2, None, "100mbit")


def test_hosts_reach_each_other_through_shaped_per_destination_classes():
    with SimulatedNetwork(3, "1gbit", "250mbit") as net:
        names = [net.namespace(i) for i in range(3)] + [net.switch]
        assert set(names) <= set(netns.leftovers())
        assert net.address(0).startswith("198.1") and net.subnet.endswith(".0/24")
        # Each host has its own address on eth0, and its hostname maps to it.
        for i in range(3):
            addrs = _in(net, i, "ip", "-4", "-o", "addr", "show", "dev", "eth0").stdout
            assert f"{net.address(i)}/24" in addrs
            with open(f"/etc/netns/{net.namespace(i)}/hosts") as f:
                assert net.address(i) in f.read()
        # Host 0 reaches host 2 over the bridge: a TCP exchange between them.
        server = subprocess.Popen(net.wrap(2, [sys.executable, "-c", textwrap.dedent("""
            import socket
            s = socket.create_server(("0.0.0.0", 5001)); c, _ = s.accept()
            c.sendall(c.recv(100).upper())""")]))
        try:
            time.sleep(0.5)
            reply = _in(net, 0, sys.executable, "-c", textwrap.dedent(f"""
                import socket
                c = socket.create_connection(("{net.address(2)}", 5001), timeout=10)
                c.sendall(b"hello"); print(c.recv(100).decode())"""))
            assert reply.stdout.strip() == "HELLO", reply.stderr
        finally:
            server.kill()
            server.wait()
        # Host 0's egress: the link class at 1 Gbit/s and one class per other
        # host capped at 250 Mbit/s, selected by destination address.
        classes = _in(net, 0, "tc", "class", "show", "dev", "eth0").stdout
        assert re.search(r"class htb 1:1 root .*rate 1Gbit ceil 1Gbit", classes), classes
        flows = re.findall(r"class htb 1:(\w+) parent 1:1 .*ceil 250Mbit", classes)
        assert sorted(flows) == ["b", "c"], classes  # hosts 1 and 2 (10 + j, hex)
        filters = _in(net, 0, "tc", "filter", "show", "dev", "eth0").stdout
        assert filters.count("flowid 1:b") == 1 and filters.count("flowid 1:c") == 1
        # A partition: host 1's port on the bridge goes down.
        net.set_link(1, up=False)
        down = _in(net, 0, sys.executable, "-c", textwrap.dedent(f"""
            import socket
            try:
                socket.create_connection(("{net.address(1)}", 5001), timeout=2)
            except OSError as e:
                print("unreachable", type(e).__name__)"""))
        assert "unreachable" in down.stdout
    assert not set(names) & set(netns.leftovers())
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in names)


def test_an_error_inside_removes_everything():
    with pytest.raises(RuntimeError, match="boom"):
        with SimulatedNetwork(2) as net:
            names = [net.namespace(0), net.namespace(1), net.switch]
            raise RuntimeError("boom")
    assert not set(names) & set(netns.leftovers())


def test_a_killed_creator_leaves_nothing_after_the_next_run():
    code = textwrap.dedent("""
        import os, signal, sys
        from herring_jax._src.launcher.netns import SimulatedNetwork
        net = SimulatedNetwork(2); net.create()
        print(net.switch, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)""")
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=60)
    stale = proc.stdout.strip()
    assert proc.returncode == -signal.SIGKILL and stale in netns.leftovers()
    assert stale in netns.orphans()
    with SimulatedNetwork(1) as net:
        # creating a network removes what dead creators left; a live one's is
        # no orphan
        assert stale not in netns.leftovers()
        assert net.switch in netns.leftovers() and net.switch not in netns.orphans()
    assert stale not in netns.leftovers()


_JOB = textwrap.dedent("""
    import numpy as np, herring_jax
    herring_jax.initialize()
    r = herring_jax.process_index()
    out = np.asarray(herring_jax.allreduce(np.full(1000, r + 1, np.float32)))
    assert (out == 3).all(), out
    print("NETNS_OK", herring_jax.describe(), flush=True)
""")


def test_launch_netns_runs_a_job_across_hosts():
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax.launch", "-n", "2", "--netns", "--host-rate", "1gbit",
         "--flow-rate", "250mbit", "--timeout", "240", "--", sys.executable, "-P", "-c", _JOB],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "NETNS_OK" in line]
    assert len(lines) == 2, proc.stdout
    # Both ranks talk over their namespace's eth0 in 198.18.0.0/15.
    assert all(re.search(r"fabric 198\.1[89]\.\d+\.0/24, domain eth0", line) for line in lines)
    assert "simulated network: 2 network namespaces" in proc.stderr


def test_launch_netns_ctrl_c_removes_the_network():
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "herring_jax.launch", "-n", "2", "--netns", "--",
         sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(2):
            assert "up" in proc.stdout.readline()
        assert len(netns.leftovers()) >= 3
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "got SIGINT" in err


def test_launch_rejects_rates_without_netns():
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax.launch", "-n", "2", "--host-rate", "1gbit", "--",
         "true"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "need --netns" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax.launch", "-n", "2", "--netns", "--host-rate", "fast",
         "--", "true"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not a rate" in proc.stderr
