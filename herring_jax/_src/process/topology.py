"""Which processes share a host, found at initialize() through the
jax.distributed key-value store, for the engine's host stage (processes of one
host reduce through memory, only each host's share crosses the network; see
xla_ffi/engine/host_stage.cc).

A host is a kernel (boot id) plus a network namespace and a pid namespace:
processes in different network namespaces of one machine (the simulated hosts
of `herring-jax launch --netns`) are different hosts, and reading another
process's memory needs its pid. Hosts are numbered in the order of their
lowest rank. Processes of a host use the host stage only if every one of them
can read every other's memory (process_vm_readv), which each process checks
by reading the others' probe word; otherwise that host reduces over the
transport, and says why once. Their host stage's steps go through shared-memory
boards (xla_ffi/engine/host_board.h) where every process of the host maps every
other's board (pidfd_getfd), else through transport messages.

Who may read a process's memory: where Yama restricts ptrace to a process's
ancestors (kernel.yama.ptrace_scope 1, Ubuntu's default), each process of a
host declares the nearest common ancestor of the host's processes as its
tracer (PR_SET_PTRACER), which admits that process and its descendants: the
launcher, mpirun's daemon or slurmstepd that started them, not every process
of the user. Only where they share no ancestor but init does it declare any
process of the user (PR_SET_PTRACER_ANY, as Open MPI and UCX do), and
describe() says so. shutdown() takes the declaration back.
HERRING_ALLOW_MEMORY_READS=0 declares nothing and turns the host's stage off.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from herring_jax._src.process import knobs


@dataclasses.dataclass(frozen=True)
class Topology:
    host_of: list[int]          # [rank] host index
    pid_of: list[int]           # [rank] pid
    memory_shared: list[bool]   # [host] its processes read each other's memory
    reasons: list[str]          # [host] why not ("" if shared)
    board_shared: list[bool] = dataclasses.field(default_factory=list)  # [host] boards mapped
    board_reasons: list[str] = dataclasses.field(default_factory=list)  # [host] why not
    readers: str = ""  # whom this process let read its memory ("": no declaration made)
    direct_bytes: int = 0  # HERRING_HOST_DIRECT_BYTES as the job holds it (rank 0's)

    def local_ranks(self, rank: int) -> list[int]:
        """The ranks on `rank`'s host (itself included), in rank order."""
        return _local_ranks(self.host_of, rank)

    def describe(self, rank: int) -> str:
        local = self.local_ranks(rank)
        host = self.host_of[rank]
        text = (f"host {host} of {len(self.memory_shared)}, {len(local)} process"
                f"{'es' if len(local) > 1 else ''} on it")
        if len(local) > 1:
            if not self.memory_shared[host]:
                text += ", host stage off: " + self.reasons[host]
            elif self.board_shared and self.board_shared[host]:
                text += ", host stage through memory, steps on shared-memory boards"
                if self.direct_bytes and len(self.memory_shared) == 1:
                    # The engine's direct path (host_stage.cc): one host only.
                    text += (f", all-reduces up to {_size(self.direct_bytes)} in one wait "
                             "(direct path)")
            else:
                why = self.board_reasons[host] if self.board_reasons else "no boards"
                text += f", host stage through memory, steps as messages ({why})"
        if self.readers:
            text += f"; memory readable by {self.readers}"
        return text


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


def host_identity() -> str:
    """This process's host: boot id, network namespace, pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"

    def namespace(kind: str) -> str:
        try:
            return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
        except OSError:
            return "?"

    return f"{boot}/net:{namespace('net')}/pid:{namespace('pid')}"


# PR_SET_PTRACER's "any process": ext.set_ptracer(-1).
_ANY = -1
# What this process declared (a pid, _ANY) and not yet took back, or None.
_declared: int | None = None


def ancestors(pid: int | None = None) -> list[int]:
    """`pid` (this process) and its ancestors, nearest first, up to the pid
    namespace's init (or as far as /proc shows them)."""
    chain = [pid or os.getpid()]
    while chain[-1] > 1 and len(chain) < 256:
        try:
            with open(f"/proc/{chain[-1]}/stat") as f:
                stat = f.read()
        except OSError:
            break
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        parent = int(stat[stat.rfind(")") + 2:].split()[1])
        if parent <= 0:
            break
        chain.append(parent)
    return chain


def nearest_common_ancestor(chains: list[list[int]]) -> int | None:
    """The first pid of chains[0] that every chain holds (a process may be
    its own ancestor here: a parent that reduces with its children), or None."""
    others = [set(c) for c in chains[1:]]
    return next((pid for pid in chains[0] if all(pid in o for o in others)), None)


def ptrace_scope() -> int:
    """kernel.yama.ptrace_scope (HERRING_TEST_PTRACE_SCOPE pretends), or -1
    without Yama."""
    pretend = knobs.get("HERRING_TEST_PTRACE_SCOPE")
    if pretend is not None:
        return pretend
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def declared_ptracer() -> int | None:
    """What this process declared as its tracer and has not taken back: a
    pid, -1 for any process of the user, or None."""
    return _declared


def _declare(ext, tracer: int) -> str:
    """Declares `tracer` (recorded only, under HERRING_TEST_PTRACE_SCOPE, for
    kernels without Yama); "" or the error."""
    global _declared
    error = "" if knobs.get("HERRING_TEST_PTRACE_SCOPE") is not None else ext.set_ptracer(tracer)
    if not error:
        _declared = tracer
    return error


def take_back_ptracer(ext) -> None:
    """Undoes this process's declaration, if it made one (shutdown())."""
    global _declared
    if _declared is not None:
        if knobs.get("HERRING_TEST_PTRACE_SCOPE") is None:
            ext.set_ptracer(0)
        _declared = None


def _let_host_read(ext, records: list[dict], local: list[int], rank: int) -> tuple[str, str]:
    """Under Yama's scope 1, declares who may read this process's memory (the
    nearest common ancestor of `local`'s processes, or any process of the user
    where they share none but init). Returns (whom, for describe(); why the
    host stage cannot read this process, or "")."""
    if ptrace_scope() != 1:
        return "", ""
    tracer = nearest_common_ancestor([records[r]["ancestors"] for r in local])
    if tracer is None or tracer <= 1:
        whom = ("any process of this user (PR_SET_PTRACER_ANY: this host's processes share "
                "no ancestor but init; kernel.yama.ptrace_scope 1)")
        tracer = _ANY
    else:
        whom = (f"pid {tracer} and its descendants (the nearest common ancestor of this "
                "host's processes; kernel.yama.ptrace_scope 1)")
    error = _declare(ext, tracer)
    if error:
        return "", (f"rank {rank} cannot let the processes of its host read its memory under "
                    f"kernel.yama.ptrace_scope 1: {error}")
    return whom, ""


def exchange(client, prefix: str, rank: int, size: int, timeout_ms: int, ext,
             enabled: bool, deny_reads: bool = False, handle=None,
             boards: bool = False, deny_boards: bool = False,
             refuse_reads: bool = False) -> Topology:
    """Publishes this process's host record, reads everyone's, checks that this
    host's processes can read each other's memory, and agrees on the result.

    Args:
      client: the jax.distributed client (key-value store).
      prefix: this initialize()'s key prefix.
      enabled: the host stage is on (rank 0's HERRING_HOST_STAGE, which every
        process follows so that all plan alike).
      deny_reads: tests only: report that this process's memory cannot be read.
      handle: the communicator, whose host board the others map (with `boards`).
      boards: the host stage's steps may go through host boards (rank 0's
        HERRING_HOST_BOARD).
      deny_boards: tests only: report that this process cannot map the others'
        boards.
      refuse_reads: this process lets no other read its memory
        (HERRING_ALLOW_MEMORY_READS=0): it declares no tracer, and its host
        reduces over the transport.
    """
    address, value = ext.memory_probe()
    board_fd, board_error = (ext.board_fd(handle) if enabled and boards and handle is not None
                             else (-1, "no board"))
    record = {"host": host_identity(), "pid": os.getpid(), "probe": [address, value],
              "board": board_fd, "board_error": board_error, "ancestors": ancestors()}
    client.key_value_set(f"{prefix}/host/{rank}", json.dumps(record))
    records = [json.loads(client.blocking_key_value_get(f"{prefix}/host/{r}", timeout_ms))
               for r in range(size)]
    index: dict[str, int] = {}
    host_of = [index.setdefault(rec["host"], len(index)) for rec in records]
    pid_of = [int(rec["pid"]) for rec in records]

    local = _local_ranks(host_of, rank)
    verdict = readers = ""
    if not enabled:
        verdict = "HERRING_HOST_STAGE=0"
    elif refuse_reads:
        verdict = (f"rank {rank} lets no other process read its memory "
                   "(HERRING_ALLOW_MEMORY_READS=0)")
    elif deny_reads:
        verdict = f"rank {rank} refuses memory reads (HERRING_TEST_DENY_MEMORY_READS)"
    elif len(local) > 1:
        readers, verdict = _let_host_read(ext, records, local, rank)
    if enabled and len(local) > 1:
        # The others probe this process only once it has declared its tracer.
        client.key_value_set(f"{prefix}/ptracer/{rank}", "1")
        for r in local:
            client.blocking_key_value_get(f"{prefix}/ptracer/{r}", timeout_ms)
    if enabled and not verdict:
        for r in local:
            if r == rank:
                continue
            address, value = records[r]["probe"]
            try:
                seen = ext.read_memory_probe(pid_of[r], address)
            except RuntimeError as e:
                verdict = (f"rank {rank} cannot read rank {r}'s memory ({e}); allow "
                           "process_vm_readv between the job's processes (same user, "
                           "kernel.yama.ptrace_scope <= 1, or CAP_SYS_PTRACE in a container)")
                break
            if seen != value:
                verdict = (f"rank {rank} read {seen:#x} from rank {r}'s probe word, expected "
                           f"{value:#x} (pid {pid_of[r]} is another process: pid namespaces?)")
                break
    board_verdict = ""
    if enabled:
        board_verdict = ("HERRING_HOST_BOARD=0" if not boards else
                         _attach_boards(records, host_of, pid_of, rank, ext, handle, deny_boards))
    client.key_value_set(f"{prefix}/memory/{rank}", verdict)
    client.key_value_set(f"{prefix}/board/{rank}", board_verdict)
    # Rank 0 gathers every host's verdicts and publishes one line that all
    # read: every process plans every group from the same table.
    hosts = len(index)
    if rank == 0:
        for kind in ("memory", "board"):
            reasons = [""] * hosts
            for r in range(size):
                why = client.blocking_key_value_get(f"{prefix}/{kind}/{r}", timeout_ms)
                if why and not reasons[host_of[r]]:
                    reasons[host_of[r]] = why
            client.key_value_set(f"{prefix}/{kind}/all", json.dumps(reasons))
    reasons = json.loads(client.blocking_key_value_get(f"{prefix}/memory/all", timeout_ms))
    board_reasons = json.loads(client.blocking_key_value_get(f"{prefix}/board/all", timeout_ms))
    topology = Topology(host_of, pid_of, [not why for why in reasons], reasons,
                        [not why and not board for why, board in zip(reasons, board_reasons)],
                        board_reasons, readers if not reasons[host_of[rank]] else "")
    if reasons[host_of[rank]]:
        take_back_ptracer(ext)  # nobody reads: nobody needs it
    if enabled and len(local) > 1 and reasons[host_of[rank]] and rank == local[0]:
        print(f"herring_jax rank {rank}: the {len(local)} processes of this host reduce over "
              f"the transport, not through memory: {reasons[host_of[rank]]}",
              file=sys.stderr, flush=True)
    return topology


def _local_ranks(host_of: list[int], rank: int) -> list[int]:
    """The ranks on `rank`'s host (itself included), in rank order."""
    return [r for r in range(len(host_of)) if host_of[r] == host_of[rank]]


def _attach_boards(records: list[dict], host_of: list[int], pid_of: list[int], rank: int,
                   ext, handle, deny: bool) -> str:
    """Maps the host board of every other process of this host; "" or why the
    host stage's steps of this host must go through messages instead (deny:
    tests only, refuse)."""
    local = _local_ranks(host_of, rank)
    if len(local) < 2:
        return ""
    if deny:
        return f"rank {rank} refuses boards (HERRING_TEST_DENY_BOARDS)"
    for r in local:
        if records[r]["board"] < 0:
            return f"rank {r} has no host board: {records[r]['board_error']}"
    for i, r in enumerate(local):
        if r == rank:
            continue
        why = ext.attach_board(handle, i, pid_of[r], records[r]["board"])
        if why:
            return f"rank {rank} cannot map rank {r}'s host board: {why}"
    return ""
