"""The driver of `herring-jax bench`: its options, the link figure, and the
start of the workers (herring-jax launch, or mpirun for the MPI peers)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from herring_jax._src.tools.bench import collectives as coll
from herring_jax._src.tools.bench.link import memory_gbps, shaped_gbps
from herring_jax._src.tools.bench.peers import CODEC_PEERS, PEERS, missing_peers

DESCRIPTION = ("herring-jax bench: herring_jax's all-reduce, reduce-scatter and all-gather "
               "against their peers, in one run.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The driver's options (shared with `herring-jax bench`)."""
    parser.add_argument("-n", "--num-processes", type=int, default=4)
    parser.add_argument("--sizes-mib", default="1,16,64",
                        help="comma-separated buffer sizes in MiB (float32): S, the buffer "
                             "of every collective")
    parser.add_argument("--collective", default="allreduce", metavar="LIST",
                        help="comma list of allreduce, reduce_scatter, all_gather, timed in "
                             "that order for every size. Of a buffer of S MiB, allreduce: "
                             "each process gives S and gets the sum; reduce_scatter: gives S "
                             "and gets its 1/n part of the sum; all_gather: gives S/n and "
                             "gets all S (S rounded up to n elements). A peer without the "
                             "collective is reported as unsupported")
    parser.add_argument("--iters", type=int, default=10, help="timed runs per size and peer")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (compile)")
    parser.add_argument("--peers", default=",".join(p for p in PEERS if p not in CODEC_PEERS),
                        help=f"comma-separated subset of {', '.join(PEERS)}")
    parser.add_argument("--codecs", default="", metavar="LIST",
                        help="also time herring with these wire codecs (bf16,fp16,int8): "
                             "peers herring_<codec>, checked against the codec's numpy model")
    parser.add_argument("--provider", default=None,
                        help="libfabric provider for herring (sets HERRING_FI_PROVIDER)")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="link bandwidth for the bound, GB/s (default: the shaped rates "
                             "with --netns, else the bound is memory: the rate at which this "
                             "machine's cores copy, measured)")
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
    net.add_argument("--processes-per-host", type=int, default=1, metavar="P",
                     help="P processes share each simulated host (hosts = n / P)")
    parser.add_argument("--servers", type=int, default=0, metavar="K",
                        help="also start K server-only processes (herring-jax launch "
                             "--servers; with --netns each on a host of its own), which sum "
                             "part of herring's all-reduces; the peers do not use them")
    parser.add_argument("--ceiling", action="store_true",
                        help="after herring, time raw TCP moving the all-reduce's bytes "
                             "between the same simulated hosts (with --servers, in their "
                             "layout), nothing summed and no flow waiting for another: what "
                             "the network allows (needs --netns and --host-rate)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--link-source", default="--link-gbps", help=argparse.SUPPRESS)
    parser.add_argument("--bound-kind", default="link", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark (or, with --worker, one worker). Returns an exit code."""
    if args.worker:  # started by a launcher other than this driver
        from herring_jax._src.tools.bench.worker import run_worker
        return run_worker(args)
    env = dict(os.environ)
    if args.provider:
        env["HERRING_FI_PROVIDER"] = args.provider
    for codec in (c for c in args.codecs.split(",") if c):
        if f"herring_{codec}" not in CODEC_PEERS:
            print(f"herring-jax bench: unknown codec {codec!r}; known: bf16, fp16, int8",
                  file=sys.stderr)
            return 2
        if f"herring_{codec}" not in args.peers.split(","):
            args.peers += f",herring_{codec}"
    try:
        chosen = coll.parse(args.collective)
    except ValueError as e:
        print(f"herring-jax bench: --collective: {e}", file=sys.stderr)
        return 2
    unknown = [p for p in args.peers.split(",") if p and p not in PEERS]
    if unknown:
        print(f"herring-jax bench: unknown peers {unknown}; known: {', '.join(PEERS)}",
              file=sys.stderr)
        return 2
    if (args.host_rate or args.flow_rate) and not args.netns:
        print("herring-jax bench: --host-rate and --flow-rate need --netns", file=sys.stderr)
        return 2
    per_host = args.processes_per_host
    if per_host < 1 or args.num_processes % per_host or (per_host > 1 and not args.netns):
        print("herring-jax bench: --processes-per-host needs --netns and must divide -n",
              file=sys.stderr)
        return 2
    if args.servers < 0:
        print(f"herring-jax bench: --servers must be at least 0, got {args.servers}",
              file=sys.stderr)
        return 2
    if args.ceiling and not (args.netns and args.host_rate and
                             args.num_processes // args.processes_per_host >= 2):
        print("herring-jax bench: --ceiling needs --netns, --host-rate and at least 2 "
              "simulated hosts", file=sys.stderr)
        return 2
    if args.ceiling and per_host > 1 and env.get("HERRING_HOST_STAGE") == "0":
        print("herring-jax bench: --ceiling takes one flow per pair of hosts, as the host "
              "stage sends; with HERRING_HOST_STAGE=0 every process crosses on its own",
              file=sys.stderr)
        return 2
    bound_kind = "link"
    if args.link_gbps:
        link_gbps, link_source = args.link_gbps, "--link-gbps"
    elif args.netns and args.host_rate:
        link_gbps, link_source = shaped_gbps(args)
    elif args.netns:
        link_gbps, link_source = None, "no rates given: no bound"
    else:
        # One host: herring's processes reduce through memory, so memory is
        # the bound (fi_pingpong's loopback figure swung from 0.5 to 2.8 GB/s).
        bound_kind = "memory"
        link_gbps, link_source = memory_gbps()
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
            if PEERS[name].mpi and name not in missing:
                # Open MPI 4.1's processes reach mpirun through PMIx over the
                # loopback of mpirun's namespace, which a process in another
                # namespace cannot reach (MPI_Init fails: "Unreachable").
                missing[name] = ("not in --netns mode: mpirun cannot start processes in "
                                 "separate network namespaces (PMIx connects over loopback)")
    present = [p for p in names if p not in missing]
    use_mpi = any(PEERS[p].mpi for p in present)
    if use_mpi and args.servers:
        print("herring-jax bench: --servers needs herring-jax launch, not mpirun: leave the "
              "MPI peers out (--peers)", file=sys.stderr)
        return 2
    json_path = os.path.abspath(args.json) if args.json else None
    with tempfile.TemporaryDirectory() as scratch:
        if json_path is None and args.plot:
            json_path = os.path.join(scratch, "bench.json")
        worker = [sys.executable, "-m", "herring_jax.bench", "--worker", "--sizes-mib",
                  args.sizes_mib, "--collective", ",".join(chosen), "--iters", str(args.iters),
                  "--warmup", str(args.warmup),
                  "--peers", ",".join(present), "--missing", json.dumps(missing)]
        if link_gbps:
            worker += ["--link-gbps", repr(link_gbps), f"--link-source={link_source}",
                       "--bound-kind", bound_kind]
        worker += ["--processes-per-host", str(per_host)]
        model = _server_model(args, env) if args.servers and args.netns and args.host_rate \
            else None
        if model:
            worker += ["--server-model", json.dumps(model)]
        if json_path is None and args.ceiling:
            json_path = os.path.join(scratch, "bench.json")
        if json_path:
            worker += ["--json", json_path]
        network = "loopback"
        if args.netns:
            hosts = args.num_processes // per_host
            network = (f"simulated: {hosts} hosts ({per_host} process"
                       f"{'es' if per_host > 1 else ''} each) on a bridge, host egress "
                       f"{args.host_rate or 'unlimited'}, each host-to-host flow "
                       f"{args.flow_rate or args.host_rate or 'unlimited'}")
        if args.servers:
            network += (f"; {args.servers} server-only process"
                        f"{'es' if args.servers > 1 else ''}"
                        f"{' on hosts of their own' if args.netns else ''}"
                        f" (share {os.environ.get('HERRING_SERVER_SHARE') or 'the split'})")
        if use_mpi:
            network += f"; Open MPI btl {args.mpi_btl or 'default (shared memory here)'}"
        env["HERRING_BENCH_NETWORK"] = network
        print(f"herring-jax bench: {args.num_processes} processes, provider "
              f"{env.get('HERRING_FI_PROVIDER') or '(default)'}, {', '.join(chosen)}, "
              f"sizes {args.sizes_mib} MiB, "
              f"{args.iters} timed runs after {args.warmup} warm-up, peers {','.join(present)}"
              f", started by {'mpirun' if use_mpi else 'herring-jax launch'}", flush=True)
        print(f"network: {network}", flush=True)
        for name, why in missing.items():
            print(f"missing peer {name}: {why}", flush=True)
        if not link_gbps:
            print(f"link: {link_source}", flush=True)
        if use_mpi:
            from herring_jax._src.tools.bench.mpirun import launch_mpi
            code = launch_mpi(args, worker, env)
        else:
            from herring_jax._src.tools.bench.workers import launch
            code = launch(args, worker, env)
        if code == 0 and args.ceiling:
            code = _ceiling(args, json_path, model)
        if code == 0 and args.plot and json_path:
            from herring_jax._src.tools.bench.plot import plot
            plot(json_path, args.plot)
    return code


def _server_model(args: argparse.Namespace, env: dict) -> dict | None:
    """The layout the workers' rank 0 places on the servers (its HERRING_SERVER_SHARE
    and HERRING_SERVER_MIN_BYTES, or the engine's split) and the shaped rates; None
    where the processes of a host cross on their own (HERRING_HOST_STAGE=0), whose
    split is over processes, not hosts."""
    from herring_jax import _herring_ffi
    from herring_jax._src.process import knobs
    if args.processes_per_host > 1 and env.get("HERRING_HOST_STAGE") == "0":
        return None
    hosts = args.num_processes // max(1, args.processes_per_host)
    requested = knobs.get("HERRING_SERVER_SHARE")
    host_bps, flow_bps = _rates(args)
    requested = -1.0 if requested is None else requested
    return {"hosts": hosts, "servers": args.servers,
            "share": _herring_ffi.server_share(hosts, args.servers, requested),
            "block_share": _herring_ffi.block_share(hosts, args.servers, requested),
            "min_bytes": knobs.get("HERRING_SERVER_MIN_BYTES"), "host_bps": host_bps,
            "flow_bps": flow_bps}


def _rates(args: argparse.Namespace) -> tuple[float, float]:
    """(host egress, per-flow cap) in bits per second; the flow's is the host's unless
    given."""
    from herring_jax._src.launcher.netns import parse_rate
    host_bps = parse_rate(args.host_rate)
    return host_bps, parse_rate(args.flow_rate) if args.flow_rate else host_bps


def _ceiling(args: argparse.Namespace, json_path: str, model: dict | None) -> int:
    """Times the network's ceiling for the all-reduce (ceiling.py), prints it beside
    herring's times from the report and adds it to the JSON; returns an exit code."""
    from herring_jax._src.tools.bench import ceiling
    with open(json_path) as f:
        report = json.load(f)
    hosts = args.num_processes // max(1, args.processes_per_host)
    host_bps, flow_bps = _rates(args)
    servers, share = (model["servers"], model["share"]) if model else (0, 0.0)
    print(f"\nnetwork ceiling: raw TCP between {hosts} worker hosts"
          f"{f' and {servers} server hosts (share {share:.3g})' if servers else ''}, the "
          f"all-reduce's bytes per flow, nothing summed, {args.iters} timed runs", flush=True)
    by_size = {}
    for mib in (float(m) for m in args.sizes_mib.split(",") if m):
        # A buffer below HERRING_SERVER_MIN_BYTES stays on the workers; the
        # server hosts are there all the same, as in herring's run (each
        # flow's guaranteed share of its host's link counts every host).
        used = share if model and mib * 2**20 >= model["min_bytes"] else 0.0
        try:
            runs = ceiling.measure(hosts, servers, used, [mib], args.host_rate,
                                   args.flow_rate, args.iters)[mib]
        except (RuntimeError, OSError) as e:
            print(f"herring-jax bench: the network ceiling failed: {e}", file=sys.stderr)
            return 1
        bound = ceiling.flow_bound_s(hosts, servers, used, mib * 2**20, host_bps, flow_bps)
        line = (f"  {mib:g} MiB: ceiling median {statistics.median(runs) * 1e3:.1f} ms "
                f"(min {min(runs) * 1e3:.1f}), {bound / min(runs):.0%} of the flow bound "
                f"{bound * 1e3:.1f} ms")
        mine = [r for r in report["results"] if r["peer"] == "herring"
                and r.get("collective", "allreduce") == "allreduce" and r["mib"] == mib]
        if mine:
            line += (f"; herring median {mine[0]['median_s'] * 1e3:.1f} ms, at "
                     f"{statistics.median(runs) / mine[0]['median_s']:.0%} of the ceiling's "
                     f"speed (minima {min(runs) / mine[0]['min_s']:.0%})")
        print(line, flush=True)
        by_size[str(mib)] = {"runs_s": runs, "flow_bound_s": bound, "share": used,
                             "servers": servers}
    report["ceiling"] = by_size
    if args.json:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m herring_jax.bench`: the driver, or a worker with --worker."""
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        from herring_jax._src.tools.bench.worker import worker_main
        return worker_main(argv)
    from herring_jax._src.tools.help_format import HelpFormatter
    parser = argparse.ArgumentParser(prog="herring-jax bench", description=DESCRIPTION,
                                     allow_abbrev=False,
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
