"""A simulated cloud network on one machine: N hosts as Linux network namespaces.

    with SimulatedNetwork(4, host_rate="1gbit", flow_rate="250mbit") as net:
        subprocess.run(net.wrap(0, ["python", "train.py"]))

Layout (everything created here is removed on exit, also after an error or a
signal; what a killed run left behind is removed by the next one):

- one "switch" namespace holding a bridge, and one namespace per host;
- each host has `eth0` (a veth pair into the bridge) with 198.18.K.(i+1)/24,
  K a /24 of the benchmarking range 198.18.0.0/15 (RFC 2544) not used by
  another live run, and `lo` up; nothing is routed outside the bridge;
- egress of each host's eth0 goes through htb: one parent class at the host
  rate, and one class per destination host capped at the flow rate, so that
  one flow (here: all traffic from one host to another) cannot fill the host's
  link, as on cloud networks that cap single flows. This kernel has no netem,
  so latency is not simulated;
- /etc/netns/<ns>/hosts maps this machine's hostname to the host's address
  (`ip netns exec` bind-mounts it over /etc/hosts), because gloo binds to what
  gethostname() resolves to.

Needs root and iproute2 (`ip`, `tc`). Standard library only.
"""

from __future__ import annotations

import ipaddress
import os
import random
import re
import shutil
import socket
import subprocess

SUPERNET = ipaddress.ip_network("198.18.0.0/15")
SUBNETS = SUPERNET.num_addresses // 256  # one /24 per run
_PREFIX = "hj"  # namespace names: hj<K>sw, hj<K>h<i>
_LOCK_DIR = "/run/herring_jax/netns"
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
_RATE_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


class NetnsError(RuntimeError):
    """The simulated network could not be set up (not root, no iproute2, ...)."""


def parse_rate(text: str) -> float:
    """Bits per second of a tc rate such as '1gbit', '250mbit' or '125mbps' (bytes).

    Raises:
      ValueError: text is not a positive rate in one of tc's units.
    """
    m = _RATE_RE.match(text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a rate: use a positive number and a unit, e.g. "
                         "1gbit, 250mbit, 100kbit (bits per second) or 125mbps (bytes)")
    return float(m.group(1)) * _RATE_SCALE[m.group(2)]


def _tc_rate(bits_per_s: float) -> str:
    return f"{int(bits_per_s)}bit"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SimulatedNetwork:
    """N hosts on one bridge, host egress and host-to-host flows rate-limited.

    Args:
      hosts: number of host namespaces (>= 1).
      host_rate: egress cap of each host, a tc rate ('1gbit'); None: no cap.
      flow_rate: cap of each host-to-host flow; None: the host rate.
      verbose: print what is created and removed.
    """

    def __init__(self, hosts: int, host_rate: str | None = None,
                 flow_rate: str | None = None, verbose: bool = False):
        if hosts < 1:
            raise ValueError(f"a simulated network needs at least 1 host, got {hosts}")
        if hosts > 250:
            raise ValueError(f"at most 250 hosts fit in a /24, got {hosts}")
        self.hosts = hosts
        self.host_bps = parse_rate(host_rate) if host_rate else None
        self.flow_bps = parse_rate(flow_rate) if flow_rate else self.host_bps
        if flow_rate and not host_rate:
            raise ValueError("a flow rate needs a host rate: give both, e.g. host 1gbit, "
                             "flow 250mbit")
        if self.host_bps and self.flow_bps and self.flow_bps > self.host_bps:
            raise ValueError(f"the flow rate {flow_rate} exceeds the host rate {host_rate}; "
                             "a flow cannot be faster than its host's link")
        self.verbose = verbose
        self.index: int | None = None
        self._lock_path: str | None = None

    # -- names and addresses ---------------------------------------------------

    def namespace(self, host: int) -> str:
        return f"{_PREFIX}{self.index}h{host}"

    @property
    def switch(self) -> str:
        return f"{_PREFIX}{self.index}sw"

    @property
    def subnet(self) -> str:
        base = int(SUPERNET.network_address) + 256 * self.index
        return f"{ipaddress.ip_address(base)}/24"

    def address(self, host: int) -> str:
        """IPv4 address of host `host` (0-based)."""
        base = int(SUPERNET.network_address) + 256 * self.index
        return str(ipaddress.ip_address(base + host + 1))

    def wrap(self, host: int, command: list[str]) -> list[str]:
        """The command line that runs `command` inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *command]

    def egress_bps(self) -> float | None:
        """The most one host can send to all the others at once (bits/s), or None."""
        if not self.host_bps:
            return None
        return min(self.host_bps, max(1, self.hosts - 1) * self.flow_bps)

    def describe(self) -> str:
        rates = ("no rate limits" if not self.host_bps else
                 f"host egress {self.host_bps / 1e6:g} Mbit/s, each host-to-host flow "
                 f"{self.flow_bps / 1e6:g} Mbit/s")
        return (f"{self.hosts} network namespaces {self.namespace(0)}.."
                f"{self.namespace(self.hosts - 1)} on a bridge, {self.subnet}, {rates}")

    # -- set-up and tear-down --------------------------------------------------

    def __enter__(self) -> "SimulatedNetwork":
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        """Builds the namespaces, bridge, links and shaping; cleans up on failure."""
        if os.geteuid() != 0:
            raise NetnsError("the simulated network needs root (network namespaces and tc)")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise NetnsError(f"'{tool}' not found: apt-get install iproute2")
        _remove_stale()
        self._claim_index()
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise
        if self.verbose:
            print(f"netns: created {self.describe()}", flush=True)

    def _claim_index(self) -> None:
        os.makedirs(_LOCK_DIR, exist_ok=True)
        candidates = list(range(SUBNETS))
        random.shuffle(candidates)
        existing = set(_namespaces())
        for k in candidates:
            if any(name.startswith(f"{_PREFIX}{k}h") or name == f"{_PREFIX}{k}sw"
                   for name in existing):
                continue
            path = os.path.join(_LOCK_DIR, str(k))
            # The lock appears with its pid already in it (written aside, then
            # linked): an empty lock would read as a dead creator's to another
            # run's _remove_stale().
            draft = os.path.join(_LOCK_DIR, f"draft.{os.getpid()}")
            with open(draft, "w") as f:
                f.write(str(os.getpid()))
            try:
                os.link(draft, path)
            except FileExistsError:
                continue
            finally:
                os.unlink(draft)
            self.index, self._lock_path = k, path
            return
        raise NetnsError(f"all {SUBNETS} subnets of {SUPERNET} are in use by live runs")

    def _build(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        _ip("-n", sw, "link", "set", "lo", "up")
        hostname = socket.gethostname()
        for i in range(self.hosts):
            ns = self.namespace(i)
            _ip("netns", "add", ns)
            # Created in the namespaces directly: nothing appears in the
            # caller's namespace, even for a moment.
            _ip("link", "add", "eth0", "netns", ns, "type", "veth",
                "peer", "name", f"p{i}", "netns", sw)
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", sw, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = f"/etc/netns/{ns}"
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.address(i)} {hostname}\n")
            if self.host_bps:
                self._shape(i)

    def _shape(self, i: int) -> None:
        ns, host, flow = self.namespace(i), self.host_bps, self.flow_bps
        tc = ["ip", "netns", "exec", ns, "tc"]
        # Class 1:1 is the host's link; 1:2 takes what matches no filter
        # (ARP); 1:(10+j) is the flow to host j. Each flow is guaranteed its
        # share of the link and may borrow up to the flow rate.
        _run(*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "2")
        _run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb",
             "rate", _tc_rate(host), "ceil", _tc_rate(host))
        _run(*tc, "class", "add", "dev", "eth0", "parent", "1:1", "classid", "1:2", "htb",
             "rate", _tc_rate(min(host, 1e6)), "ceil", _tc_rate(host))
        share = min(flow, host / max(1, self.hosts - 1))
        for j in range(self.hosts):
            if j == i:
                continue
            cls = f"1:{10 + j:x}"
            _run(*tc, "class", "add", "dev", "eth0", "parent", "1:1", "classid", cls, "htb",
                 "rate", _tc_rate(share), "ceil", _tc_rate(flow))
            _run(*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio",
                 "1", "u32", "match", "ip", "dst", f"{self.address(j)}/32", "flowid", cls)
            # A short queue per flow, as in a cloud network's switches. htb's
            # default leaf queue is txqueuelen (1000) packets of up to 64 KiB
            # with GSO: seconds of queueing at these rates, which would delay
            # every small message (acks, rendezvous requests) behind the bulk.
            _run(*tc, "qdisc", "add", "dev", "eth0", "parent", cls, "bfifo", "limit",
                 str(self.queue_bytes()))

    def queue_bytes(self) -> int:
        """Each flow's queue: 10 ms at the flow rate, at least 128 KiB."""
        return max(128 << 10, int(self.flow_bps / 8 * 0.010))

    def set_link(self, host: int, up: bool) -> None:
        """Takes host `host`'s link to the bridge down (a partition) or up again."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "up" if up else "down")

    def destroy(self) -> None:
        """Removes every namespace, link and file this network created. Idempotent."""
        if self.index is None:
            return
        subnet = self.subnet
        _delete_index(self.index)
        if self.verbose:
            print(f"netns: removed the namespaces of {subnet}", flush=True)
        self.index, self._lock_path = None, None


# -- helpers -----------------------------------------------------------------

def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.stdout.strip()}")


def _ip(*args: str) -> None:
    _run("ip", *args)


def _namespaces() -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _delete_index(k: int) -> None:
    """Deletes the namespaces of subnet k (links go with them), its files and lock."""
    ours = re.compile(rf"^{_PREFIX}{k}(sw|h\d+)$")
    for name in _namespaces():
        if ours.match(name):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
    try:
        os.unlink(os.path.join(_LOCK_DIR, str(k)))
    except FileNotFoundError:
        pass


def _owner_alive(k: int) -> bool:
    """Whether subnet k's lock names a live process (its creator, still running)."""
    try:
        with open(os.path.join(_LOCK_DIR, str(k))) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        pid = 0
    return bool(pid) and _pid_alive(pid)


def _remove_stale() -> None:
    """Removes networks whose creator died without cleaning up (e.g. SIGKILL)."""
    try:
        entries = os.listdir(_LOCK_DIR)
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.isdigit() and not _owner_alive(int(entry)):
            _delete_index(int(entry))


def leftovers() -> list[str]:
    """Namespaces of this module that exist now (for tests: none after a run)."""
    return [n for n in _namespaces() if re.match(rf"^{_PREFIX}\d+(sw|h\d+)$", n)]


def orphans() -> list[str]:
    """Namespaces of this module whose creator is gone: what a finished run left
    behind. Unlike leftovers(), a network that another live run (a test beside
    this one) holds is not among them."""
    found = []
    for name in leftovers():
        k = int(re.match(rf"^{_PREFIX}(\d+)", name).group(1))
        if not _owner_alive(k):
            found.append(name)
    return found


__all__ = ["SimulatedNetwork", "NetnsError", "parse_rate", "leftovers", "orphans"]
