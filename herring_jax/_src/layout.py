"""Who takes part in one reduction: this process's devices, the group each of
them reduces in, and the processes of every group, as the handler's attributes
describe them.

Every process computes the same plan from the same mesh, so the numbering of
groups (streams) agrees everywhere without any exchange.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from herring_jax._src import jax_compat
from herring_jax._src.errors import HerringError

# The handler's "whichever device runs this" for single-device computations.
ANY_DEVICE = -1
# Streams per call that can reach the wire: the tag has 6 bits for it, and the
# last value is the engine's control stream. Only groups that share a process
# need different streams, and groups inside one process never travel, so this
# bounds the process-spanning groups one process takes part in, not the total.
MAX_STREAMS = 63


@dataclasses.dataclass(frozen=True)
class Plan:
    local_devices: list[int]   # this process's devices (global ids), or [ANY_DEVICE]
    device_streams: list[int]  # the stream (group) of each of them
    stream_ranks: list[int]    # processes of every stream, concatenated
    stream_offsets: list[int]  # where each stream's processes start; one more at the end


def device_number(platform: str):
    """How the handler on `platform` names the device it runs on (XLA's
    DeviceOrdinal): on XLA:CPU the global device id (measured: 0, 1, 2048,
    2049 for two processes of two devices); on XLA:CUDA the process-local
    ordinal, which PJRT's GPU client takes from the local device it runs the
    executable on, i.e. jax's Device.local_hardware_id."""
    if platform == "cuda":
        return lambda d: d.local_hardware_id
    return lambda d: d.id


def plan(ctx, axes, groups, one_per_process: bool, platform: str = "cpu") -> Plan:
    """The plan of a call being lowered: across processes (axes None) or across
    the named mesh axes, optionally split by lax's axis_index_groups."""
    number = device_number(platform)
    if axes is None:
        return _across_processes(ctx, one_per_process, number)
    mesh = jax_compat.manual_mesh(ctx)
    if mesh is None:
        raise NameError(f"herring_jax.psum over axes {axes} must be called inside "
                        "jax.shard_map (or jax.pmap); outside, use herring_jax.allreduce")
    return _across_axes(mesh, tuple(axes), groups, number)


def contributors(ctx) -> int:
    """How many devices an allreduce (axes None) of this computation sums."""
    devices = jax_compat.computation_devices(ctx)
    if devices is None or devices == [None]:
        return jax.process_count()
    return len(devices)


def group_size(axes, groups) -> int:
    """Devices in each group of a psum over `axes` (while tracing)."""
    if groups is not None:
        return len(groups[0])
    return jax_compat.axes_size(axes)


def _across_processes(ctx, one_per_process: bool, number) -> Plan:
    me = jax.process_index()
    devices = jax_compat.computation_devices(ctx)
    local = None
    if devices == [None]:
        local = [ANY_DEVICE]
    elif devices is not None:
        local = [number(d) for d in devices if d.process_index == me]
    if one_per_process and (local is None or len(local) > 1):
        # (None: jax lowers a multi-device computation without its assignment.)
        raise ValueError(
            f"herring_jax.broadcast runs on one device per process, but this computation "
            f"spans several devices of process {me}: call it outside jit, or in a jit "
            "whose inputs live on one device")
    if local is None:
        raise HerringError("herring_jax cannot lower without a concrete device assignment")
    if not local:
        raise HerringError(f"process {me} has no device in this computation")
    n = jax.process_count()
    return Plan(local, [0] * len(local), list(range(n)), [0, n])


def _across_axes(mesh, axes: tuple, groups, number) -> Plan:
    me = jax.process_index()
    names = list(mesh.axis_names)
    missing = [a for a in axes if a not in names]
    if missing:
        raise NameError(f"unbound axis name(s) {missing}; the mesh has axes {names}")
    reduced = [names.index(a) for a in axes]
    others = [i for i in range(len(names)) if i not in reduced]
    sizes = [mesh.devices.shape[i] for i in reduced]
    # A group: the devices that share their coordinates on the other axes; with
    # axis_index_groups, split further by the index along the reduced axes (in
    # the order given, as lax numbers it).
    members: dict[tuple, list] = {}
    for idx in np.ndindex(*mesh.devices.shape):
        base = tuple(idx[i] for i in others)
        if groups is None:
            key = base
        else:
            index = int(np.ravel_multi_index([idx[i] for i in reduced], sizes))
            key = base + (_index_group(groups, index, int(np.prod(sizes))),)
        members.setdefault(key, []).append(mesh.devices[idx])
    keys = sorted(members)
    procs = [sorted({d.process_index for d in members[k]}) for k in keys]
    streams = _color(procs)
    # (Device numbers are unique within this process only, on CUDA.)
    stream_of = {number(d): streams[g] for g, k in enumerate(keys) for d in members[k]
                 if d.process_index == me}
    local = [number(d) for d in mesh.devices.flat if d.process_index == me]
    # Per stream, the processes of the group of that stream this process is in.
    mine = {}
    for g, k in enumerate(keys):
        if me in procs[g]:
            mine[streams[g]] = procs[g]
    count = max(mine) + 1 if mine else 1
    ranks, offsets = [], [0]
    for s in range(count):
        ranks += mine.get(s, [me])
        offsets.append(len(ranks))
    return Plan(local, [stream_of[d] for d in local], ranks, offsets)


def _index_group(groups, index: int, size: int) -> int:
    for g, group in enumerate(groups):
        if index in group:
            return g
    raise ValueError(f"axis_index_groups {groups} do not cover axis index {index} "
                     f"of an axis of size {size}")


def _color(procs: list[list[int]]) -> list[int]:
    """Stream numbers such that groups sharing a process differ (greedy, in
    group order: the same on every process). Groups that cross processes are
    numbered first: only they travel, and the wire has room for MAX_STREAMS."""
    taken: dict[int, set[int]] = {}  # process -> streams its groups use
    streams = [0] * len(procs)
    order = sorted(range(len(procs)), key=lambda g: (len(procs[g]) == 1, g))
    for g in order:
        ranks = procs[g]
        used = set().union(*(taken.get(r, set()) for r in ranks))
        s = next(i for i in range(len(procs) + 1) if i not in used)
        if s >= MAX_STREAMS and len(ranks) > 1:
            raise NotImplementedError(
                f"herring_jax reduces at most {MAX_STREAMS} groups that span processes per "
                f"process in one call; this call puts process {ranks[0]} in more (groups "
                "inside one process are not limited)")
        for r in ranks:
            taken.setdefault(r, set()).add(s)
        streams[g] = s
    return streams
