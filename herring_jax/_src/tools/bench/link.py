"""The figures behind the bound of `herring-jax bench`: the shaped rates of the
simulated network, or, on one host, the rate at which this machine's cores copy
memory (the processes of one host reduce through memory)."""

from __future__ import annotations

import multiprocessing
import os
import time

_COPY_MIB = 64
_COPY_REPEATS = 8


def _copy_worker(start, done) -> None:
    import numpy as np
    src = np.ones(_COPY_MIB << 18, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before the clock starts
    start.wait()
    for _ in range(_COPY_REPEATS):
        np.copyto(dst, src)
    done.put(time.perf_counter())


def memory_gbps(processes: int | None = None) -> tuple[float, str]:
    """Bytes per second (GB/s) that `processes` processes (default: one per
    core) copy together, each a 64 MiB buffer 8 times at once: a copied byte is
    read once and written once."""
    processes = processes or os.cpu_count() or 1
    ctx = multiprocessing.get_context("fork")
    start, done = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_copy_worker, args=(start, done)) for _ in range(processes)]
    for w in workers:
        w.start()
    time.sleep(0.5)  # every worker has its buffers faulted in
    began = time.perf_counter()
    start.set()
    ended = max(done.get(timeout=120) for _ in workers)
    for w in workers:
        w.join()
    copied = processes * _COPY_REPEATS * (_COPY_MIB << 20)
    return copied / (ended - began) / 1e9, (f"measured: {processes} processes copying "
                                            f"{_COPY_MIB} MiB buffers at once (numpy)")


def shaped_gbps(args) -> tuple[float, str]:
    """What one host can send to all others at once in the simulated network, GB/s."""
    from herring_jax._src.launcher.netns import parse_rate
    hosts = args.num_processes // max(1, getattr(args, "processes_per_host", 1) or 1)
    host = parse_rate(args.host_rate)
    flow = parse_rate(args.flow_rate) if args.flow_rate else host
    egress = min(host, max(1, hosts - 1) * flow)
    flows = f"{hosts - 1} flow{'' if hosts == 2 else 's'}"
    return egress / 8e9, (f"shaped: min(host {args.host_rate}, {flows} x "
                          f"{args.flow_rate or args.host_rate})")
