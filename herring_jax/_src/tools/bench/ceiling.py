"""What the simulated network allows an all-reduce's traffic, with or without
server-only processes: `herring-jax bench --ceiling`.

Two figures for one layout (h worker hosts, k server hosts, a share x of each
buffer of B bytes on the servers; docs/guides/servers.md):

- the flow bound: every host's flows share its egress H alike, each at most
  the per-flow cap F (max-min fairness: what TCP flows through one link, and
  the simulated network's htb classes, converge to). A worker host sends
  2 (1-x) B / h to each other worker host and x B / k to each server, a server
  x B / k to each worker; each direction of a flow carries as much. A split
  that loads some flows more than others ends with those alone, each at F;
- the ceiling: raw TCP moving exactly those bytes between the same simulated
  hosts, with nothing summed and no flow waiting for another. herring cannot
  beat it; the gap to the flow bound is the network's own (headers, htb's
  borrowing between classes).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

_CHUNK = 1 << 20
_PORT = 29611


def flow_bytes(hosts: int, servers: int, share: float, nbytes: float,
               collective: str = "allreduce") -> list[list[float]]:
    """[i][j]: the bytes host i sends host j in one all-reduce (or reduce-scatter,
    all-gather) of `nbytes` (hosts 0..hosts-1 are the workers', the rest the
    servers'). A reduce-scatter's or all-gather's share is of each block (b =
    nbytes / hosts, a worker's part): a worker sends (1 - x) b of each block to
    its owner (reduce-scatter) or of its own block to each other worker
    (all-gather), and x b / k of each block (its own) to each server; a server
    sends x b / k of each block to its owner (of every other block to each
    worker)."""
    total = hosts + servers
    out = [[0.0] * total for _ in range(total)]
    block = nbytes / hosts
    for i in range(total):
        for j in range(total):
            if i == j or (i >= hosts and j >= hosts):
                continue
            if i < hosts and j < hosts:
                out[i][j] = (2 * (1 - share) * nbytes / hosts if collective == "allreduce"
                             else (1 - share) * block)
            elif share <= 0:
                continue
            elif collective == "allreduce":
                out[i][j] = share * nbytes / servers
            elif i < hosts:  # a worker to a server
                out[i][j] = share * (nbytes if collective == "reduce_scatter" else block) / servers
            else:  # a server to a worker
                out[i][j] = share * block / servers * (1 if collective == "reduce_scatter"
                                                       else hosts - 1)
    return out


def fair_time_s(flows: list[float], host_bps: float, flow_bps: float) -> float:
    """Seconds for one host to send `flows` (bytes each) at once when they share
    its egress `host_bps` alike, each at most `flow_bps` (progressive filling)."""
    left = sorted(b * 8 for b in flows if b > 0)
    elapsed = 0.0
    while left:
        rate = min(flow_bps, host_bps / len(left))
        step = left[0] / rate
        elapsed += step
        left = [b - rate * step for b in left[1:]]
    return elapsed


def flow_bound_s(hosts: int, servers: int, share: float, nbytes: float, host_bps: float,
                 flow_bps: float, collective: str = "allreduce") -> float:
    """The collective's least time under fair sharing: its busiest host's sends."""
    plan = flow_bytes(hosts, servers, share, nbytes, collective)
    return max(fair_time_s(row, host_bps, flow_bps) for row in plan)


def measure(hosts: int, servers: int, share: float, sizes_mib: list[float], host_rate: str,
            flow_rate: str | None, iters: int, timeout: float = 600) -> dict[float, list[float]]:
    """Seconds of each timed run (the slowest host's) of raw TCP moving the
    layout's bytes on a new simulated network of hosts + servers hosts, per
    size (one untimed run first)."""
    from herring_jax._src.launcher.netns import SimulatedNetwork
    total = hosts + servers
    with SimulatedNetwork(total, host_rate=host_rate, flow_rate=flow_rate) as net:
        addrs = ",".join(net.address(i) for i in range(total))
        plans = {str(mib): flow_bytes(hosts, servers, share, int(mib * 2**20))
                 for mib in sizes_mib}
        procs = []
        for i in range(total):
            mine = {mib: {str(j): int(b) for j, b in enumerate(plan[i]) if b > 0}
                    for mib, plan in plans.items()}
            # The bytes host i receives from each peer: what that peer sends it.
            theirs = {mib: {str(j): int(plan[j][i]) for j in range(total) if plan[j][i] > 0}
                      for mib, plan in plans.items()}
            # By path, with the standard library alone: -P keeps this
            # file's folder off sys.path.
            cmd = [sys.executable, "-P", os.path.abspath(__file__), "--flow-worker",
                   str(i), addrs, json.dumps({"send": mine, "recv": theirs}), str(iters)]
            procs.append(subprocess.Popen(net.wrap(i, cmd), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + timeout
        outs = []
        for i, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"the network ceiling's host {i} did not finish within "
                                   f"{timeout:.0f} s")
            if p.returncode != 0:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"the network ceiling's host {i} failed (exit "
                                   f"{p.returncode}): {err.strip()[-500:]}")
            outs.append(json.loads(out))
    return {mib: [max(o[str(mib)][r] for o in outs) for r in range(iters)] for mib in sizes_mib}


def _connect(me: int, addrs: list[str], peers: list[int]) -> dict[int, socket.socket]:
    """One TCP connection to each peer, carrying both directions."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((addrs[me], _PORT))
    listener.listen(len(addrs))
    socks: dict[int, socket.socket] = {}

    def accept(count: int) -> None:
        for _ in range(count):
            conn, _ = listener.accept()
            socks[int.from_bytes(conn.recv(4, socket.MSG_WAITALL), "little")] = conn

    acceptor = threading.Thread(target=accept, args=(sum(p < me for p in peers),))
    acceptor.start()
    for p in (p for p in peers if p > me):
        for _ in range(600):
            try:
                s = socket.create_connection((addrs[p], _PORT), timeout=5)
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise SystemExit(f"host {me} cannot reach host {p} at {addrs[p]}:{_PORT}")
        s.settimeout(None)
        s.sendall(me.to_bytes(4, "little"))
        socks[p] = s
    acceptor.join()
    listener.close()
    for s in socks.values():
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return socks


def _flow_worker(me: int, addrs: list[str], plan: dict, iters: int) -> None:
    peers = sorted({int(p) for size in plan["send"].values() for p in size} |
                   {int(p) for size in plan["recv"].values() for p in size})
    socks = _connect(me, addrs, peers)
    data = memoryview(bytearray(_CHUNK))

    def send(peer: int, nbytes: int) -> None:
        while nbytes > 0:
            socks[peer].sendall(data[:min(nbytes, _CHUNK)])
            nbytes -= min(nbytes, _CHUNK)

    def recv(peer: int, nbytes: int) -> None:
        into = memoryview(bytearray(_CHUNK))
        while nbytes > 0:
            got = socks[peer].recv_into(into, min(nbytes, _CHUNK))
            if got == 0:
                raise ConnectionError(f"host {peer} closed its connection early")
            nbytes -= got

    times: dict[str, list[float]] = {}
    for mib in plan["send"]:
        times[mib] = []
        for run in range(iters + 1):
            began = time.perf_counter()
            threads = [threading.Thread(target=send, args=(int(p), b))
                       for p, b in plan["send"][mib].items()]
            threads += [threading.Thread(target=recv, args=(int(p), b))
                        for p, b in plan["recv"][mib].items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if run:  # the first run is untimed: connections' windows open
                times[mib].append(time.perf_counter() - began)
    print(json.dumps(times), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--flow-worker", nargs=4, metavar=("ME", "ADDRS", "PLAN", "ITERS"),
                        required=True)
    args = parser.parse_args(argv)
    me, addrs, plan, iters = args.flow_worker
    _flow_worker(int(me), addrs.split(","), json.loads(plan), int(iters))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
