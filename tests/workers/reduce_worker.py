"""Reduces every (dtype, op, size) case given on the command line and checks
each result bitwise against the numpy rank-order reference.

Usage (under the launcher):
  python tests/workers/reduce_worker.py --dtypes float32,int32 --ops sum,mean \
      --counts 0,1,7,4097 --mib 1,16 [--devices D]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.process import jax_compat  # noqa: E402


def cases(args):
    for dtype in args.dtypes.split(","):
        for op in args.ops.split(","):
            if op == "mean" and dtype.startswith("int"):
                continue
            itemsize = common.NP_DTYPES[dtype].itemsize
            counts = [int(c) for c in args.counts.split(",") if c]
            counts += [int(float(m) * 2**20) // itemsize for m in args.mib.split(",") if m]
            if dtype in args.big_dtypes.split(","):
                counts += [int(float(m) * 2**20) // itemsize
                           for m in args.big_mib.split(",") if m]
            for count in counts:
                yield dtype, op, count


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default=",".join(common.NP_DTYPES))
    parser.add_argument("--ops", default="sum,mean")
    parser.add_argument("--counts", default="0,1,7,4097")
    parser.add_argument("--mib", default="")
    parser.add_argument("--big-mib", default="",
                        help="sizes in MiB for --big-dtypes only (the largest sizes cost most "
                             "in the numpy reference, and chunking does not depend on dtype)")
    parser.add_argument("--big-dtypes", default="float32")
    parser.add_argument("--codec", default="none",
                        help="wire codec of every reduction (float32 leaves travel with it); "
                             "a comma-separated list runs every case once per codec, each "
                             "case named <codec>:<dtype>/<op>/<count>")
    parser.add_argument("--in-place", action="store_true",
                        help="reduce through allreduce_gradients inside jax.jit, whose "
                             "buckets XLA:CPU reduces in place (the engine's input is its "
                             "output); --ops mean, floating dtypes, one device")
    parser.add_argument("--devices", type=int, default=1,
                        help="local devices per process that contribute")
    parser.add_argument("--describe", action="store_true",
                        help="also report herring_jax.describe() (provider, registration)")
    parser.add_argument("--stats", action="store_true",
                        help="also report herring_jax.stats() after the cases")
    parser.add_argument("--deny-reads-rank", type=int, default=-1,
                        help="this rank reports that its memory cannot be read (its host "
                             "must then reduce over the transport)")
    parser.add_argument("--deny-boards-rank", type=int, default=-1,
                        help="this rank reports that it cannot map the others' host boards "
                             "(its host's steps must then go as messages)")
    parser.add_argument("--slow-reader-rank", type=int, default=-1,
                        help="this rank waits --slow-reader-ms in every host-stage call "
                             "before it reads the others' result slices")
    parser.add_argument("--slow-reader-ms", type=int, default=800)
    parser.add_argument("--rank-env", action="append", default=[], metavar="R:KEY=VALUE",
                        help="rank R sets KEY=VALUE in its environment before initialize() "
                             "(a knob that differs between processes)")
    parser.add_argument("--exit-after-shutdown", action="store_true",
                        help="end with os._exit(0) right after herring_jax.shutdown(): "
                             "no jax.distributed shutdown barrier holds the memory of a "
                             "process that is done")
    parser.add_argument("--idle-s", type=float, default=0.0,
                        help="then stay idle this long and report the heartbeats sent meanwhile")
    args = parser.parse_args()

    jax.config.update("jax_enable_x64", True)  # float64 and int64 cases
    if args.exit_after_shutdown:
        jax.config.update("jax_enable_recoverability", True)
    if os.environ.get("HERRING_PROCESS_ID") == str(args.deny_reads_rank):
        os.environ["HERRING_TEST_DENY_MEMORY_READS"] = "1"
    if os.environ.get("HERRING_PROCESS_ID") == str(args.deny_boards_rank):
        os.environ["HERRING_TEST_DENY_BOARDS"] = "1"
    if os.environ.get("HERRING_PROCESS_ID") == str(args.slow_reader_rank):
        os.environ["HERRING_TEST_GATHER_DELAY_MS"] = str(args.slow_reader_ms)
    for item in args.rank_env:
        who, setting = item.split(":", 1)
        if os.environ.get("HERRING_PROCESS_ID") == who:
            key, value = setting.split("=", 1)
            os.environ[key] = value
    herring_jax.initialize()
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    ndev = args.devices
    assert jax.local_device_count() >= ndev, jax.local_devices()

    if ndev > 1:
        # Every device of every process contributes: shard_map over a global
        # mesh, each device's block reduced by allreduce inside it.
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = jax.sharding.Mesh(np.array(devices), ("d",))
        sharding = NamedSharding(mesh, P("d"))

        def make_fn(op, codec):
            return jax.jit(jax.shard_map(lambda x: herring_jax.allreduce(x, op=op, codec=codec),
                                         mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    if args.in_place:
        assert ndev == 1 and args.ops == "mean", "--in-place: --ops mean, one device"
        gradients = herring_jax.allreduce_gradients()
        mean_in_place = jax.jit(lambda g: gradients.update(g, gradients.init(g))[0])

    fns = {}
    codecs = args.codec.split(",")
    all_cases = [(c, case) for c in codecs for case in cases(args)]
    for salt, (wire, (dtype, op, count)) in enumerate(all_cases):
        mine = [common.make_input(dtype, count, rank * ndev + d, salt) for d in range(ndev)]
        if args.in_place:
            got = [np.asarray(mean_in_place(mine[0]))]
        elif ndev == 1:
            got = [np.asarray(herring_jax.allreduce(mine[0], op=op, codec=wire))]
        else:
            local = np.stack(mine)  # (ndev, count): one row per local device
            x = jax.make_array_from_process_local_data(sharding, local,
                                                       (nproc * ndev, count))
            fn = fns.setdefault((op, wire), make_fn(op, wire))
            out = fn(x)
            got = [np.asarray(s.data)[0] for s in sorted(out.addressable_shards,
                                                         key=lambda s: s.device.id)]
        # Every rank must hold the same bits on every device; rank 0 also
        # checks them against the numpy reference (the driver then compares
        # the other ranks' digests with rank 0's).
        ok = len(got) == ndev and all(common.bitwise_equal(g, got[0]) for g in got)
        extra = {}
        if rank == 0:
            inputs = [[common.make_input(dtype, count, p * ndev + d, salt)
                       for d in range(ndev)] for p in range(nproc)]
            hosts = common.hosts_from_env(nproc)
            codec = wire if dtype == "float32" else "none"
            want = common.reference(dtype, op, inputs, hosts, codec=codec)
            ok = ok and common.bitwise_equal(got[0], want)
            if codec != "none":
                # Whether the codec lost anything: the exact reduction's bits.
                exact = common.reference(dtype, op, inputs, hosts)
                extra["exact"] = common.bitwise_equal(got[0], exact)
        name = f"{dtype}/{op}/{count}" if len(codecs) == 1 else f"{wire}:{dtype}/{op}/{count}"
        common.report(name, ok, digest=common.digest(got[0]), devices=len(got), **extra)
    if args.describe:
        common.report("describe", True, describe=herring_jax.describe())
    if args.stats:
        common.report("stats", True, stats=herring_jax.stats())
    if args.idle_s > 0:
        import time
        # First let the full-rate heartbeats of the reductions just done end
        # (ranks that waited asked for them for 3 intervals).
        time.sleep(1.0)
        before = herring_jax.stats()["heartbeats_sent"]
        time.sleep(args.idle_s)
        common.report("idle", True, heartbeats_sent=herring_jax.stats()["heartbeats_sent"] - before)
    rank, nproc = herring_jax.process_index(), herring_jax.process_count()
    herring_jax.shutdown()
    if args.exit_after_shutdown:
        sys.stdout.flush()
        sys.stderr.flush()
        # A task that vanishes without jax.distributed's shutdown makes jax
        # end every other one still running (status 134, "Socket closed"),
        # unless the job is recoverable (set before initialize below); the
        # coordinator's end (rank 0's) ends them all whatever the setting. So
        # rank 0 leaves last, once every other rank has left.
        client = jax_compat.distributed_client()
        if rank:
            client.key_value_set(f"reduce_worker/leaving/{rank}", str(os.getpid()))
        else:
            import time
            for r in range(1, nproc):
                pid = int(client.blocking_key_value_get(f"reduce_worker/leaving/{r}", 120_000))
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and _alive(pid):
                    time.sleep(0.01)
        os._exit(0)
    return 0


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


if __name__ == "__main__":
    sys.exit(main())
