"""Who takes part in one reduction: every device of the computation, the group
each of them reduces in, and the processes and stream of every group, as the
handler's attributes describe them.

The description is the same on every process, and must be: XLA's run id,
which names a reduction across processes, derives from the executable's
fingerprint, and that covers the custom call's attributes (see
xla_ffi/call_identity.cc). So devices are named by (process, index among that
process's local devices), never by a process-local number, and a computation
that lives on one process's devices is described as "each process's own
devices" (EVERY_PROCESS). The handler finds its own entry from its rank and a
table of its local devices (set by initialize()).

Every process computes the same plan from the same mesh, so the numbering of
groups (streams) agrees everywhere without any exchange.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from herring_jax._src.process import jax_compat
from herring_jax._src.process.errors import HerringError

# device_procs / group_ranks: "each process, its own" (a computation local to
# every process). device_locals: "whichever device runs this" (a single-device
# computation lowered before its device is known).
EVERY_PROCESS = -1
ANY_DEVICE = -1
# Streams per call that can reach the wire: the tag has 6 bits for it, and the
# last value is the engine's control stream. Only groups that share a process
# need different streams, and groups inside one process never travel, so this
# bounds the process-spanning groups one process takes part in, not the total.
MAX_STREAMS = 63


@dataclasses.dataclass(frozen=True)
class Plan:
    device_procs: list[int]   # each participating device's process, or EVERY_PROCESS
    device_locals: list[int]  # its index among its process's local devices, or ANY_DEVICE
    device_groups: list[int]  # the group it reduces in
    group_streams: list[int]  # each group's stream (wire id)
    group_ranks: list[int]    # processes of every group, concatenated
    group_offsets: list[int]  # where each group's processes start; one more at the end
    # Each device's index in its group (lax's axis_index over the reduced axes,
    # or its place in its axis_index_groups group): the block a reduce-scatter
    # gives it and an all-gather takes from it. ANY_BLOCK: the process's place
    # among the group's processes (one device per process).
    device_blocks: list[int]


ANY_BLOCK = -1


def plan(ctx, axes, groups, one_per_process: bool, platform: str = "cpu") -> Plan:
    """The plan of a call being lowered: across processes (axes None) or across
    the named mesh axes, optionally split by lax's axis_index_groups."""
    if axes is None:
        return _across_processes(ctx, one_per_process, platform)
    mesh = jax_compat.manual_mesh(ctx)
    if mesh is None:
        raise NameError(f"herring_jax.psum over axes {axes} must be called inside "
                        "jax.shard_map (or jax.pmap); outside, use herring_jax.allreduce")
    auto = jax_compat.auto_axes(ctx)
    if auto:
        # XLA's partitioner would replicate the reduction over those axes,
        # and a custom call with side effects cannot be replicated (XLA
        # refuses it when compiling, naming only herring_allreduce).
        raise NotImplementedError(
            f"herring_jax: a collective over axes {tuple(axes)} inside a jax.shard_map that "
            f"leaves mesh axes {list(auto)} to XLA's partitioner (shard_map's axis_names= "
            "names only some mesh axes): herring's collectives run only where the shard_map "
            "is manual over every mesh axis of more than one device. Leave out axis_names= "
            "(or name every mesh axis), or use the jax.lax collective here.")
    return _across_axes(mesh, tuple(axes), groups, platform)


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


def _describe(devices: list, platform: str) -> tuple[list[int], list[int], bool]:
    """(procs, locals, local_only) of `devices`: each one's process and index
    among its process's local devices (jax's order, known to every process); a
    computation on this process's devices only is described as each process's
    own (EVERY_PROCESS)."""
    me = jax.process_index()
    local_only = all(d.process_index == me for d in devices)
    procs = [EVERY_PROCESS if local_only else d.process_index for d in devices]
    order = {}
    for p in sorted({d.process_index for d in devices}):
        local = jax.local_devices(process_index=p, backend=platform)
        order.update({d: i for i, d in enumerate(local)})
    return procs, [order[d] for d in devices], local_only


def _across_processes(ctx, one_per_process: bool, platform: str) -> Plan:
    me = jax.process_index()
    devices = jax_compat.computation_devices(ctx)
    n = jax.process_count()
    everyone = ([0], list(range(n)), [0, n])
    if devices == [None]:
        return Plan([EVERY_PROCESS], [ANY_DEVICE], [0], *everyone, [ANY_BLOCK])
    if devices is None:
        # (jax lowers a multi-device computation without its assignment.)
        if one_per_process:
            raise ValueError(_ONE_PER_PROCESS.format(me=me))
        raise HerringError("herring_jax cannot lower without a concrete device assignment")
    procs, locals_, _ = _describe(devices, platform)
    mine = [d for d in devices if d.process_index == me]
    if one_per_process and len(mine) > 1:
        raise ValueError(_ONE_PER_PROCESS.format(me=me))
    if not mine:
        raise HerringError(f"process {me} has no device in this computation")
    # One device per process where blocks matter (one_per_process): its rank.
    blocks = [ANY_BLOCK if p == EVERY_PROCESS else p for p in procs]
    return Plan(procs, locals_, [0] * len(devices), *everyone, blocks)


_ONE_PER_PROCESS = (
    "herring_jax's process-level broadcast, reduce_scatter and allgather run on one device "
    "per process, but this computation spans several devices of process {me}: call it "
    "outside jit, or in a jit whose inputs live on one device (inside jax.shard_map, use "
    "psum_scatter / all_gather over a mesh axis)")


def _places(mesh, axes: tuple) -> list[tuple[tuple, tuple, int]]:
    """(mesh index, coordinates on the other axes, index along the reduced
    axes as lax's axis_index numbers it) of every device, in mesh order."""
    names = list(mesh.axis_names)
    reduced = [names.index(a) for a in axes]
    others = [i for i in range(len(names)) if i not in reduced]
    sizes = [mesh.devices.shape[i] for i in reduced]
    return [(idx, tuple(idx[i] for i in others),
             int(np.ravel_multi_index([idx[i] for i in reduced], sizes)))
            for idx in np.ndindex(*mesh.devices.shape)]


def _across_axes(mesh, axes: tuple, groups, platform: str) -> Plan:
    names = list(mesh.axis_names)
    missing = [a for a in axes if a not in names]
    if missing:
        raise NameError(f"unbound axis name(s) {missing}; the mesh has axes {names}")
    size = int(np.prod([mesh.shape[a] for a in axes]))
    # A group: the devices that share their coordinates on the other axes; with
    # axis_index_groups, split further by the index along the reduced axes (in
    # the order given, as lax numbers it).
    group_of = {}
    block_of = {}
    members: dict[tuple, list] = {}
    for idx, base, index in _places(mesh, axes):
        if groups is None:
            key = base
            block_of[idx] = index
        else:
            g = _index_group(groups, index, size)
            key = base + (g,)
            block_of[idx] = list(groups[g]).index(index)
        members.setdefault(key, []).append(mesh.devices[idx])
        group_of[idx] = key
    keys = sorted(members)
    number_of = {k: g for g, k in enumerate(keys)}
    procs = [sorted({d.process_index for d in members[k]}) for k in keys]
    streams = _color(procs)
    flat = [mesh.devices[idx] for idx in np.ndindex(*mesh.devices.shape)]
    device_procs, device_locals, local_only = _describe(flat, platform)
    ranks, offsets = [], [0]
    for p in procs:
        ranks += [EVERY_PROCESS] if local_only else p
        offsets.append(len(ranks))
    return Plan(device_procs, device_locals,
                [number_of[group_of[idx]] for idx in np.ndindex(*mesh.devices.shape)],
                streams, ranks, offsets,
                [block_of[idx] for idx in np.ndindex(*mesh.devices.shape)])


@dataclasses.dataclass(frozen=True)
class LocalSplit:
    """A psum's devices as D devices on each of P processes, the same way for
    every coordinate of the other mesh axes, in axis-index terms (lax's
    axis_index_groups over the reduced axes): `local` has one group per
    process (its D indices, in order), `across` one per local position d (the
    d-th index of every process, in process order)."""
    local: list[list[int]]
    across: list[list[int]]

    @property
    def per_process(self) -> int:
        return len(self.local[0])

    @property
    def contributors(self) -> int:
        return len(self.local) * len(self.local[0])


def local_split(ctx, axes, groups) -> LocalSplit | None:
    """How a psum over `axes` of the enclosing shard_map splits into a sum
    inside each process and one across processes, or None where it does not:
    axis_index_groups given, a process with one device (or all devices on one
    process), or processes holding different numbers of the group's devices,
    or a placement that differs between the other axes' coordinates."""
    if axes is None or groups is not None:
        return None
    mesh = jax_compat.manual_mesh(ctx)
    if mesh is None:
        return None
    if any(a not in mesh.axis_names for a in axes):
        return None
    # Per coordinate of the other axes: each process's indices along the
    # reduced axes, in order.
    by_base: dict[tuple, dict[int, list[int]]] = {}
    for idx, base, index in _places(mesh, axes):
        by_process = by_base.setdefault(base, {})
        by_process.setdefault(mesh.devices[idx].process_index, []).append(index)
    patterns = {tuple(sorted(tuple(sorted(g)) for g in p.values())) for p in by_base.values()}
    if len(patterns) != 1:
        return None
    pattern = [list(g) for g in patterns.pop()]
    if len(pattern) < 2 or len(pattern[0]) < 2:
        return None
    if any(len(g) != len(pattern[0]) for g in pattern):
        return None
    return LocalSplit(pattern, [[g[d] for g in pattern] for d in range(len(pattern[0]))])


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
