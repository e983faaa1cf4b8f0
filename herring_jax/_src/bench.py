"""herring-jax bench: herring_jax's all-reduce against its peers, in one run.

  herring-jax bench -n 4 [--provider 'tcp;ofi_rxm'] [--sizes-mib 1,16,64] [--json out.json]
  python -m herring_jax.bench -n 4 ...

The driver (main / run) starts n worker processes through herring-jax launch;
each worker (worker_main) times every peer on the same float32 buffers in the
same order, checks every result, and rank 0 gathers the timings through the
jax.distributed key-value store and prints the table. Workers can also be
started by any other launcher (SLURM, mpirun) with `--worker`.

Peers: herring (herring_jax.allreduce under jax.jit), jax_psum (jax.lax.psum
in shard_map over one device per process, i.e. JAX's gloo CPU collectives),
mpi4jax and mpi4py (Open MPI's Allreduce), torch_gloo (torch.distributed's
gloo all_reduce, PyTorch DDP's CPU backend). A peer whose package or launcher
is missing is reported as missing, with how to install it. With an MPI peer
the workers are started by mpirun (every peer still runs in the same
processes); otherwise by herring-jax launch. A peer is a class in PEERS.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util as importlib_util
import json
import os
import platform
import re
import shutil
import socket
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

import numpy as np

_KV_PREFIX = "herring_jax_bench"
_KV_TIMEOUT_MS = 600_000
_BOUND_FORMULA = "bound = 2(n-1)/n * bytes / link"


# -- peers -------------------------------------------------------------------

class _Peer:
    """One all-reduce implementation, timed on the same buffers as the others.

    configure() runs before jax.distributed starts (backend choices must
    precede it); __init__(rank, n) builds what does not depend on the size;
    prepare(local) takes this process's buffer; run() reduces it and blocks;
    result(out) is this process's copy of the sum as numpy.
    """

    label = ""

    @staticmethod
    def configure() -> None:
        pass

    def __init__(self, rank: int, n: int):
        self._fn = self._arg = None

    def prepare(self, local: np.ndarray) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Untimed, before each run: restores the input of an in-place peer."""

    def run(self):
        import jax
        return jax.block_until_ready(self._fn(self._arg))

    @staticmethod
    def result(out) -> np.ndarray:
        return np.asarray(out)


class _HerringPeer(_Peer):
    label = "herring_jax.allreduce under jax.jit, process-local buffer"

    def __init__(self, rank: int, n: int):
        import jax
        import herring_jax
        super().__init__(rank, n)
        self._fn = jax.jit(lambda v: herring_jax.allreduce(v))

    def prepare(self, local: np.ndarray) -> None:
        import jax.numpy as jnp
        self._arg = jnp.asarray(local)


class _JaxPsumPeer(_Peer):
    label = "jax.lax.psum in jitted shard_map, one device per process (gloo)"

    @staticmethod
    def configure() -> None:
        import jax
        # Without it jax has no cross-process CPU collectives; gloo is also
        # jax 0.10's default, set here so the peer is what the table says.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")

    def __init__(self, rank: int, n: int):
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        super().__init__(rank, n)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if len(devices) != n:
            raise SystemExit(f"jax_psum wants one device per process, found {len(devices)} "
                             f"devices for {n} processes")
        mesh = Mesh(np.array(devices), ("p",))
        # jax.sharding.Mesh axes are not Explicit, so shard_map takes the
        # NamedSharding input as is.
        self._sharding = NamedSharding(mesh, P("p"))
        self._fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "p"), mesh=mesh,
                                         in_specs=P("p"), out_specs=P("p")))

    def prepare(self, local: np.ndarray) -> None:
        import jax
        # Global shape (n * count,): shard i is process i's buffer.
        self._arg = jax.make_array_from_process_local_data(self._sharding, local)

    @staticmethod
    def result(out) -> np.ndarray:
        return np.asarray(out.addressable_shards[0].data)


class _Mpi4jaxPeer(_Peer):
    label = "mpi4jax.allreduce under jax.jit (Open MPI)"
    needs = ("mpi4jax", "mpi4py")
    install = ("apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py mpi4jax "
               "(with nvcc on PATH but no CUDA headers: CUDA_ROOT=<empty dir>)")
    mpi = True

    def __init__(self, rank: int, n: int):
        import jax
        import mpi4jax
        from mpi4py import MPI
        super().__init__(rank, n)
        _check_mpi_world(MPI, rank, n)
        self._fn = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=MPI.COMM_WORLD))

    def prepare(self, local: np.ndarray) -> None:
        import jax.numpy as jnp
        self._arg = jnp.asarray(local)


class _Mpi4pyPeer(_Peer):
    label = "mpi4py Comm.Allreduce of numpy buffers (Open MPI)"
    needs = ("mpi4py",)
    install = "apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py"
    mpi = True

    def __init__(self, rank: int, n: int):
        from mpi4py import MPI
        super().__init__(rank, n)
        _check_mpi_world(MPI, rank, n)
        self._comm, self._sum = MPI.COMM_WORLD, MPI.SUM

    def prepare(self, local: np.ndarray) -> None:
        self._in, self._out = local, np.empty_like(local)

    def run(self):
        self._comm.Allreduce(self._in, self._out, op=self._sum)
        return self._out


class _TorchGlooPeer(_Peer):
    label = "torch.distributed.all_reduce, gloo backend (PyTorch DDP on CPU)"
    needs = ("torch",)
    install = "pip install torch==2.13.0"

    def __init__(self, rank: int, n: int):
        import datetime as dt
        import torch.distributed as dist
        from herring_jax._src import jax_compat
        super().__init__(rank, n)
        # The rendezvous: a port free on rank 0's host, passed on through
        # jax.distributed's key-value store; the host is the coordinator's.
        client = jax_compat.distributed_client()
        if rank == 0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("0.0.0.0", 0))
                client.key_value_set(f"{_KV_PREFIX}/torch_port", str(sock.getsockname()[1]))
        port = client.blocking_key_value_get(f"{_KV_PREFIX}/torch_port", _KV_TIMEOUT_MS)
        host = os.environ.get("HERRING_COORDINATOR_ADDRESS", "127.0.0.1:0").rsplit(":", 1)[0]
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=n, timeout=dt.timedelta(seconds=600))
        self._dist = dist

    def prepare(self, local: np.ndarray) -> None:
        import torch
        self._local = local
        self._tensor = torch.from_numpy(local.copy())

    def reset(self) -> None:
        # all_reduce works in place: each timed run starts from this rank's data.
        np.copyto(self._tensor.numpy(), self._local)

    def run(self):
        self._dist.all_reduce(self._tensor)
        return self._tensor

    @staticmethod
    def result(out) -> np.ndarray:
        return out.numpy()


def _check_mpi_world(MPI, rank: int, n: int) -> None:
    world = MPI.COMM_WORLD
    if world.Get_size() != n or world.Get_rank() != rank:
        raise SystemExit(f"MPI rank {world.Get_rank()} of {world.Get_size()} is not jax "
                         f"process {rank} of {n}: start the workers with mpirun")


PEERS = {"herring": _HerringPeer, "jax_psum": _JaxPsumPeer, "mpi4jax": _Mpi4jaxPeer,
         "mpi4py": _Mpi4pyPeer, "torch_gloo": _TorchGlooPeer}


def missing_peers(names: list[str]) -> dict[str, str]:
    """Peers among `names` that cannot run here, each with the reason and the fix."""
    missing = {}
    for name in names:
        peer = PEERS[name]
        absent = [m for m in getattr(peer, "needs", ()) if importlib_util.find_spec(m) is None]
        if absent:
            missing[name] = f"{', '.join(absent)} not installed ({peer.install})"
        elif getattr(peer, "mpi", False) and shutil.which("mpirun") is None:
            missing[name] = f"mpirun not found ({peer.install})"
    return missing


# -- worker ------------------------------------------------------------------

def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="herring-jax bench --worker")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--sizes-mib", default="1,16,64")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peers", default="herring,jax_psum")
    p.add_argument("--link-gbps", type=float, default=None)
    p.add_argument("--link-source", default="--link-gbps")
    p.add_argument("--json", default=None)
    p.add_argument("--missing", default="{}", help="JSON: peers that could not run, and why")
    return p


def _pattern(count: int, rank: int) -> np.ndarray:
    # Small integers: every partial sum is exact in float32 whatever the
    # summation order, so the check can demand equality; the ramp catches
    # parts written to the wrong place, which a constant fill would not.
    return ((np.arange(count, dtype=np.int64) % 251 + 1) * (rank + 1)).astype(np.float32)


def _measure(peer, local, expected, iters: int, warmup: int) -> tuple[list[float], bool]:
    peer.prepare(local)
    for _ in range(warmup):  # the first call compiles
        peer.reset()
        out = peer.run()
    times = []
    for _ in range(iters):
        peer.reset()
        start = time.perf_counter()
        out = peer.run()
        times.append(time.perf_counter() - start)
    correct = bool(np.array_equal(peer.result(out), expected))
    return times, correct


def worker_main(argv: list[str] | None = None) -> int:
    """Runs in each process: times every peer, rank 0 prints and saves.

    Args:
      argv: worker arguments (default sys.argv[1:]); see _worker_parser.

    Returns:
      0, or 3 on rank 0 when any rank got a wrong sum.
    """
    return _worker(_worker_parser().parse_args(sys.argv[1:] if argv is None else argv))


def _worker(args: argparse.Namespace) -> int:
    names = [p for p in args.peers.split(",") if p]
    unknown = [p for p in names if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    sizes = [float(s) for s in args.sizes_mib.split(",") if s]
    if "OMPI_COMM_WORLD_RANK" in os.environ:  # started by mpirun
        os.environ.setdefault("HERRING_PROCESS_ID", os.environ["OMPI_COMM_WORLD_RANK"])
        logs, mpi_rank = os.environ.get("HERRING_BENCH_LOGDIR"), os.environ["OMPI_COMM_WORLD_RANK"]
        if logs and mpi_rank != "0":
            fd = os.open(os.path.join(logs, f"rank{mpi_rank}.log"),
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
    for name in names:
        PEERS[name].configure()
    import jax
    import herring_jax
    from herring_jax._src import jax_compat

    herring_jax.initialize()
    rank, n = herring_jax.process_index(), herring_jax.process_count()
    peers = {name: PEERS[name](rank, n) for name in names}
    records = []
    # Same sizes and peers in the same order on every rank: both libraries
    # need collectives issued in one order everywhere.
    for mib in sizes:
        count = int(mib * 2**20) // 4
        local = _pattern(count, rank)
        expected = _pattern(count, 0) * np.float32(n * (n + 1) // 2)
        for name, peer in peers.items():
            times, correct = _measure(peer, local, expected, args.iters, args.warmup)
            records.append({"mib": mib, "peer": name, "times": times, "correct": correct})
        del local, expected
    # Gathered through jax.distributed's key-value store rather than an
    # all-reduce, so the figures do not depend on the code under test.
    client = jax_compat.distributed_client()
    client.key_value_set(f"{_KV_PREFIX}/{rank}", json.dumps(records))
    code = 0
    if rank == 0:
        per_rank = [json.loads(client.blocking_key_value_get(f"{_KV_PREFIX}/{r}", _KV_TIMEOUT_MS))
                    for r in range(n)]
        report = _report(args, n, sizes, names, per_rank, herring_jax.describe(), jax)
        code = 0 if all(r["correct"] for r in report["results"]) else 3
    herring_jax.shutdown()
    return code


def _summarize(names, sizes, per_rank) -> list[dict]:
    results = []
    for i, (mib, peer) in enumerate((m, p) for m in sizes for p in names):
        ranks = [records[i] for records in per_rank]
        assert all(r["mib"] == mib and r["peer"] == peer for r in ranks)
        times = [r["times"] for r in ranks]
        results.append({
            "mib": mib, "peer": peer,
            # Each rank's median and minimum, then the slowest rank: a
            # collective is done when its last process is.
            "median_s": max(statistics.median(t) for t in times),
            "min_s": max(min(t) for t in times),
            # Iteration k as the job saw it (its slowest rank).
            "times_s": [max(col) for col in zip(*times)],
            "times_by_rank_s": times,
            "correct": all(r["correct"] for r in ranks),
            "wrong_ranks": [k for k, r in enumerate(ranks) if not r["correct"]],
        })
    return results


def _bound_s(nbytes: float, n: int, link_gbps: float | None) -> float | None:
    # Each process sends (n-1)/n of the buffer to the other servers and gets
    # (n-1)/n back as sums; its server does the mirror image, so each link
    # direction carries 2(n-1)/n * bytes at least.
    if not link_gbps or n < 2:
        return None
    return 2 * (n - 1) / n * nbytes / (link_gbps * 1e9)


def _table(results, n, link_gbps) -> str:
    by = {(r["mib"], r["peer"]): r for r in results}
    rows = [f"{'size MiB':>8} {'peer':>9} {'median ms':>10} {'min ms':>8} {'algbw GB/s':>10} "
            f"{'busbw GB/s':>10} {'herring x':>10} {'bound ms':>9} {'ok':>3}"]
    for r in results:
        nbytes = r["mib"] * 2**20
        algbw = nbytes / r["median_s"] / 1e9
        herring = by.get((r["mib"], "herring"))
        speedup = f"{r['median_s'] / herring['median_s']:.2f}" if herring else "-"
        bound = _bound_s(nbytes, n, link_gbps)
        # "!" marks a run faster than the bound: then the link figure is not
        # what the transport can carry, and the bound is no bound.
        bound_s = "-" if bound is None else (
            f"{bound * 1e3:.1f}" + ("!" if r["median_s"] < bound else ""))
        rows.append(f"{r['mib']:>8g} {r['peer']:>9} {r['median_s'] * 1e3:>10.1f} "
                    f"{r['min_s'] * 1e3:>8.1f} {algbw:>10.3f} {algbw * 2 * (n - 1) / n:>10.3f} "
                    f"{speedup:>10} {bound_s:>9} {'yes' if r['correct'] else 'NO':>3}")
    return "\n".join(rows)


def _report(args, n, sizes, names, per_rank, describe, jax) -> dict:
    results = _summarize(names, sizes, per_rank)
    link = (f"{args.link_gbps:.2f} GB/s from {args.link_source}" if args.link_gbps
            else "not given (pass --link-gbps)")
    print(f"transport: {describe}")
    print("peers: " + "; ".join(f"{name} = {PEERS[name].label}" for name in names))
    print("time: median (and min) of each rank's timed runs, slowest rank; algbw = bytes / median; "
          "busbw = algbw * 2(n-1)/n; herring x = peer median / herring median (>1: herring "
          "faster)")
    print(f"{_BOUND_FORMULA}, link = {link}")
    print(_table(results, n, args.link_gbps), flush=True)
    if any(r["median_s"] < (_bound_s(r["mib"] * 2**20, n, args.link_gbps) or 0) for r in results):
        print("!: faster than the bound: the link figure is below what the transport carries "
              "(fi_pingpong has one message in flight and shares the CPU), so this bound is "
              "no bound")
    for r in results:
        if not r["correct"]:
            print(f"WRONG RESULT: {r['peer']} {r['mib']:g} MiB on ranks {r['wrong_ranks']}")
    missing = json.loads(getattr(args, "missing", "{}"))
    for name, why in missing.items():
        print(f"MISSING peer {name}: {why}")
    report = {
        "n": n, "sizes_mib": sizes, "peers": names, "iters": args.iters, "warmup": args.warmup,
        "provider": os.environ.get("HERRING_FI_PROVIDER") or "(default)", "transport": describe,
        "link_gbps": args.link_gbps, "link_source": args.link_source if args.link_gbps else None,
        "bound_formula": _BOUND_FORMULA, "results": results, "missing": missing,
        "network": os.environ.get("HERRING_BENCH_NETWORK", "loopback"),
        "jax": jax.__version__, "jaxlib": _jaxlib_version(), "python": platform.python_version(),
        "host": platform.node(), "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


def _jaxlib_version() -> str:
    import jaxlib
    return getattr(jaxlib, "__version__", "?")


# -- driver ------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The driver's options (shared with `herring-jax bench`)."""
    parser.add_argument("-n", "--num-processes", type=int, default=4)
    parser.add_argument("--sizes-mib", default="1,16,64",
                        help="comma-separated buffer sizes in MiB (float32)")
    parser.add_argument("--iters", type=int, default=10, help="timed runs per size and peer")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (compile)")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated subset of {', '.join(PEERS)}")
    parser.add_argument("--provider", default=None,
                        help="libfabric provider for herring (sets HERRING_FI_PROVIDER)")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="link bandwidth for the bound, GB/s (default: measure fi_pingpong)")
    parser.add_argument("--json", default=None, help="write every timing to this file")
    parser.add_argument("--mpi-btl", default=None, metavar="LIST",
                        help="Open MPI transports, e.g. tcp,self (default: Open MPI's choice, "
                             "shared memory between local processes)")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="draw bandwidth per size and peer into this PNG (matplotlib)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole job")
    net = parser.add_argument_group(
        "simulated network", "one network namespace per process (needs root and iproute2)")
    net.add_argument("--netns", action="store_true",
                     help="run each process as its own host on a simulated network")
    net.add_argument("--host-rate", metavar="RATE", help="each host's egress cap, e.g. 1gbit")
    net.add_argument("--flow-rate", metavar="RATE",
                     help="each host-to-host flow's cap, e.g. 250mbit")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--link-source", default="--link-gbps", help=argparse.SUPPRESS)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pingpong_gbps(provider: str) -> tuple[float | None, str]:
    """Best one-way bandwidth of fi_pingpong (RDM, 1-16 MiB) between two local processes."""
    tool = shutil.which("fi_pingpong")
    if tool is None:
        return None, "fi_pingpong not found (apt-get install libfabric-bin)"
    best = None
    for mib in (1, 4, 16):
        port = _free_port()
        common = [tool, "-p", provider, "-e", "rdm", "-I", "20", "-S", str(mib << 20)]
        server = subprocess.Popen(common + ["-B", str(port)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.3)  # the server must listen before the client connects
            out = subprocess.run(common + ["-P", str(port), "127.0.0.1"], capture_output=True,
                                 text=True, timeout=60).stdout
            server.wait(timeout=10)
        except (OSError, subprocess.SubprocessError):
            out = ""
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        # Columns: bytes #sent #ack total time MB/sec usec/xfer ...; MB/sec is
        # 1e6 bytes per second, one way (a message's half round trip).
        m = re.search(rf"^\s*{mib}m\s+\d+\s+=\d+\s+\S+\s+\S+\s+([\d.]+)", out, re.M)
        if m:
            best = max(best or 0.0, float(m.group(1)) / 1e3)
    if best is None:
        return None, f"fi_pingpong -p '{provider}' failed"
    return best, f"fi_pingpong -p '{provider}' -e rdm, best of 1/4/16 MiB, same host"


def _shaped_gbps(args) -> tuple[float, str]:
    """What one host can send to all others at once in the simulated network, GB/s."""
    from herring_jax._src.netns import parse_rate
    n = args.num_processes
    host = parse_rate(args.host_rate)
    flow = parse_rate(args.flow_rate) if args.flow_rate else host
    egress = min(host, max(1, n - 1) * flow)
    flows = f"{n - 1} flow{'' if n == 2 else 's'}"
    return egress / 8e9, (f"shaped: min(host {args.host_rate}, {flows} x "
                          f"{args.flow_rate or args.host_rate})")


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark (or, with --worker, one worker). Returns an exit code."""
    if args.worker:  # started by a launcher other than this driver
        return _worker(args)
    env = dict(os.environ)
    if args.provider:
        env["HERRING_FI_PROVIDER"] = args.provider
    provider = env.get("HERRING_FI_PROVIDER") or "tcp;ofi_rxm"
    unknown = [p for p in args.peers.split(",") if p and p not in PEERS]
    if unknown:
        print(f"herring-jax bench: unknown peers {unknown}; known: {', '.join(PEERS)}",
              file=sys.stderr)
        return 2
    if (args.host_rate or args.flow_rate) and not args.netns:
        print("herring-jax bench: --host-rate and --flow-rate need --netns", file=sys.stderr)
        return 2
    if args.link_gbps:
        link_gbps, link_source = args.link_gbps, "--link-gbps"
    elif args.netns and args.host_rate:
        link_gbps, link_source = _shaped_gbps(args)
    else:
        link_gbps, link_source = _pingpong_gbps(provider)
    # Workers import the very package this driver runs from: its parent goes
    # first on PYTHONPATH and they start in an empty directory, since -m puts
    # the working directory ahead of everything.
    import herring_jax
    root = os.path.dirname(os.path.dirname(os.path.abspath(herring_jax.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    names = [p for p in args.peers.split(",") if p]
    missing = missing_peers(names)
    if args.netns:
        for name in names:
            if getattr(PEERS[name], "mpi", False) and name not in missing:
                # Open MPI 4.1's processes reach mpirun through PMIx over the
                # loopback of mpirun's namespace, which a process in another
                # namespace cannot reach (MPI_Init fails: "Unreachable").
                missing[name] = ("not in --netns mode: mpirun cannot start processes in "
                                 "separate network namespaces (PMIx connects over loopback)")
    present = [p for p in names if p not in missing]
    use_mpi = any(getattr(PEERS[p], "mpi", False) for p in present)
    json_path = os.path.abspath(args.json) if args.json else None
    with tempfile.TemporaryDirectory() as scratch:
        if json_path is None and args.plot:
            json_path = os.path.join(scratch, "bench.json")
        worker = [sys.executable, "-m", "herring_jax.bench", "--worker", "--sizes-mib",
                  args.sizes_mib, "--iters", str(args.iters), "--warmup", str(args.warmup),
                  "--peers", ",".join(present), "--missing", json.dumps(missing)]
        if link_gbps:
            worker += ["--link-gbps", repr(link_gbps), f"--link-source={link_source}"]
        if json_path:
            worker += ["--json", json_path]
        network = "loopback"
        if args.netns:
            network = (f"simulated: one namespace per process on a bridge, host egress "
                       f"{args.host_rate or 'unlimited'}, each host-to-host flow "
                       f"{args.flow_rate or args.host_rate or 'unlimited'}")
        if use_mpi:
            network += f"; Open MPI btl {args.mpi_btl or 'default (shared memory here)'}"
        env["HERRING_BENCH_NETWORK"] = network
        print(f"herring-jax bench: {args.num_processes} processes, provider "
              f"{env.get('HERRING_FI_PROVIDER') or '(default)'}, sizes {args.sizes_mib} MiB, "
              f"{args.iters} timed runs after {args.warmup} warm-up, peers {','.join(present)}"
              f", started by {'mpirun' if use_mpi else 'herring-jax launch'}", flush=True)
        print(f"network: {network}", flush=True)
        for name, why in missing.items():
            print(f"missing peer {name}: {why}", flush=True)
        if not link_gbps:
            print(f"link: {link_source}", flush=True)
        code = (_launch_mpi if use_mpi else _launch)(args, worker, env)
        if code == 0 and args.plot and json_path:
            _plot(json_path, args.plot)
    return code


def _launch_mpi(args, worker: list[str], env: dict) -> int:
    """Starts the workers with mpirun (MPI peers need MPI's own launcher), on
    loopback; Open MPI picks its transports itself unless --mpi-btl says."""
    from herring_jax._src.launch import free_port
    env = dict(env, HERRING_NUM_PROCESSES=str(args.num_processes), PYTHONUNBUFFERED="1",
               HERRING_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}")
    env.setdefault("JAX_PLATFORMS", "cpu")
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "-n", str(args.num_processes)]
    if args.mpi_btl:
        command += ["--mca", "btl", args.mpi_btl]
    # mpirun merges every rank's output: ranks other than 0 write theirs to
    # files instead (shown if the run fails).
    with tempfile.TemporaryDirectory() as logs:
        env["HERRING_BENCH_LOGDIR"] = logs
        code = _run_workers(command + worker, env, args.timeout, lambda line: line)
        if code != 0:
            for name in sorted(os.listdir(logs)):
                with open(os.path.join(logs, name), errors="replace") as f:
                    sys.stderr.write(f"--- {name} ---\n{f.read()[-4000:]}")
    return code


def _launch(args, worker: list[str], env: dict) -> int:
    """Starts the workers under herring-jax launch and shows rank 0's output."""
    launcher = [sys.executable, "-m", "herring_jax.launch", "-n", str(args.num_processes),
                "--timeout", str(args.timeout)]
    if getattr(args, "netns", False):
        launcher.append("--netns")
        for flag, value in (("--host-rate", args.host_rate), ("--flow-rate", args.flow_rate)):
            if value:
                launcher += [flag, value]
    launcher += ["--", *worker]
    return _run_workers(launcher, env, None,
                        lambda line: line[len("[rank 0] "):]
                        if line.startswith("[rank 0] ") else None)


def _run_workers(command: list[str], env: dict, timeout: float | None, rank0) -> int:
    """Runs the workers' launcher, showing rank 0's lines (rank0(line) -> text
    or None); the other lines are shown only on failure."""
    others: deque[str] = deque(maxlen=100)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, env=env, cwd=tmp, stdout=subprocess.PIPE,
                                stderr=err, text=True, start_new_session=True)
        timer = None
        if timeout:
            timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
            timer.start()
        try:
            for line in proc.stdout:
                text = rank0(line)
                # gloo prints its connection chatter on stdout.
                if text is not None and not text.startswith("[Gloo]"):
                    sys.stdout.write(text if text.endswith("\n") else text + "\n")
                    sys.stdout.flush()
                else:
                    others.append(line)
            code = proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops every worker
            proc.wait()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if code != 0:
            err.seek(0)
            sys.stderr.write("".join(others) + err.read()[-8000:])
            print(f"herring-jax bench: workers failed (exit {code})", file=sys.stderr)
    return code


def _plot(json_path: str, png_path: str) -> None:
    """Algorithmic bandwidth per size, one line per peer, and the bound."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: skipped, matplotlib is not installed (pip install matplotlib)")
        return
    with open(json_path) as f:
        report = json.load(f)
    n = report["n"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for peer in report["peers"]:
        rows = sorted((r["mib"], r["mib"] * 2**20 / r["median_s"] / 1e9)
                      for r in report["results"] if r["peer"] == peer)
        ax.plot([m for m, _ in rows], [bw for _, bw in rows], marker="o", label=peer,
                linewidth=2.5 if peer == "herring" else 1.5)
    if report.get("link_gbps"):
        sizes = sorted(report["sizes_mib"])
        ax.plot(sizes, [report["link_gbps"] / (2 * (n - 1) / n)] * len(sizes), "k--",
                label="bound (link / (2(n-1)/n))")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("buffer size, MiB (float32)")
    ax.set_ylabel("algorithmic bandwidth, GB/s (bytes / median time)")
    import textwrap
    ax.set_title(textwrap.fill(f"all-reduce, {n} processes, {report.get('network', 'loopback')}",
                               95), fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    print(f"plot: {png_path}")


def main(argv: list[str] | None = None) -> int:
    """`python -m herring_jax.bench`: the driver, or a worker with --worker."""
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return worker_main(argv)
    parser = argparse.ArgumentParser(prog="herring-jax bench",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
