"""Every HERRING_* environment variable, declared once with its default.

The knob table of docs/guides/knobs.md is this table. Values are read when used, so a
test or launcher may set them in the environment before ``initialize()``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0 or 1, got {text!r}")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"expected a positive number, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"expected an integer >= 0, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(f"expected a number >= 0, got {text!r}")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"expected a share from 0 to 1, got {text!r}")
    return value


_TEST_FAULTS = ("", "abort-at-start", "no-staging", "no-posting", "withdraw-after-ready",
                "bad-alloc", "slow-server-threads")


def _test_fault(text: str) -> str:
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in _TEST_FAULTS:
            raise ValueError(f"expected comma-separated names of {', '.join(_TEST_FAULTS[1:])} "
                             f"or empty, got {text!r}")
    return ",".join(names)


def _device_fault(text: str) -> str:
    value = text.strip()
    for rule in filter(None, value.split(",")):
        parts = rule.split(":")
        ok = (len(parts) in (3, 4) and parts[0] in ("delay", "fail", "kill")
              and (len(parts) == 4) == (parts[0] == "delay") and parts[1] in ("host", "device")
              and parts[2].isdigit() and int(parts[2]) >= 1
              and (len(parts) == 3 or parts[3].isdigit()))
        if not ok:
            raise ValueError(f"expected KIND:WAY:N[:MS] rules (delay:host:2:1500, fail:device:1, "
                             f"kill:host:3), got {rule!r}")
    return value


def _rows_or_share(text: str) -> int | float:
    if any(c in text for c in ".eE"):
        share = float(text)
        if not 0.0 < share <= 1.0:
            raise ValueError(f"expected a share of the rows in (0, 1], got {text!r}")
        return share
    return _positive_int(text)


def _identity(text: str) -> str:
    value = text.strip().lower()
    if value not in ("auto", "program", "launch"):
        raise ValueError(f"expected auto, program or launch, got {text!r}")
    return value


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in [
        Knob("HERRING_FI_PROVIDER", "", str,
             "libfabric provider: efa, tcp;ofi_rxm, shm, udp;ofi_rxd, net, ... "
             "Empty: efa where present, else tcp;ofi_rxm. shm with libfabric 1.17 has hung "
             "a reduction now and then (1 to 3 jobs in 100 in the suite's stress loop) when "
             "chunks arrive before their receive is posted; one host's processes sum "
             "through the host stage by default, without shm."),
        Knob("HERRING_FI_IFACE", "", str,
             "Interface name or local IP address IP providers bind to. Empty: the "
             "address this host uses to reach the coordinator."),
        Knob("HERRING_FI_FORCE_MR", False, _bool,
             "1: ask the provider for FI_MR_LOCAL and register every buffer of every "
             "message with fi_mr_reg (deregistered when it completes), passing its "
             "descriptor, even if the provider does not need it: the path of a provider "
             "that only works that way, exercised in CI on providers that do not. EFA no "
             "longer takes it: herring_jax asks without FI_MR_LOCAL first, so that EFA "
             "registers buffers itself through its registration cache."),
        Knob("HERRING_CHUNK_BYTES", 1 << 20, _positive_int,
             "Pipelining unit: each server part is sent in messages of this size; between "
             "hosts, of about a quarter of the part, between HERRING_MIN_CHUNK_BYTES and "
             "this. Rank 0's value holds for the whole job."),
        Knob("HERRING_MIN_CHUNK_BYTES", 16 << 10, _positive_int,
             "Smallest pipelining unit between hosts (unless HERRING_CHUNK_BYTES is "
             "smaller): small parts still travel in several messages, so that their "
             "results flow while their last contributions arrive; on a fast fabric, where "
             "a message costs more than that, raise it to HERRING_CHUNK_BYTES. Rank 0's "
             "value holds for the whole job."),
        Knob("HERRING_SERVER_THREADS", 1, _positive_int,
             "Threads per process that sum the parts this process serves."),
        Knob("HERRING_TIMEOUT_S", 300.0, _positive_float,
             "No reduction waits longer; then every surviving rank raises HerringError."),
        Knob("HERRING_CUDA_DONE_GRACE_S", 300.0, _non_negative_float,
             "XLA:CUDA: how much longer than HERRING_TIMEOUT_S a reduction's done waits "
             "for it (the GPU may take that long to reach the start's copy to the host) "
             "before it fails; lower it where a start whose done never pairs must not "
             "hold the job for long (the GPU check, tests/gpu/run.sh)."),
        Knob("HERRING_DEVICE_LOCAL_SUM", False, _bool,
             "XLA:CUDA: a psum over D >= 2 GPUs on each of P >= 2 processes sums inside "
             "each process on the GPUs first (XLA's reduce-scatter and all-gather) and "
             "copies 1/D of each buffer to the host per GPU, instead of every GPU's whole "
             "buffer; not bitwise the host path's sum (docs/guides/gpus.md). Off until "
             "verified on GPUs. Read when a reduction is lowered."),
        Knob("HERRING_PEER_TIMEOUT_S", 30.0, _positive_float,
             "A rank a reduction waits for that has sent nothing (data or heartbeat) "
             "for this long is declared dead: every surviving rank raises HerringError "
             "naming it (at most HERRING_TIMEOUT_S)."),
        Knob("HERRING_HEARTBEAT_S", None, _non_negative_float,
             "Interval of the liveness messages a rank sends the members of the reductions "
             "it is in, and the ranks waiting for it (every other rank gets one each quarter "
             "of HERRING_PEER_TIMEOUT_S); 0 turns them off (then only HERRING_TIMEOUT_S "
             "detects a dead peer). Unset: 1 s, but off over shm, whose libfabric 1.17 "
             "provider lost data messages between heartbeats."),
        Knob("HERRING_STALL_S", 60.0, _non_negative_float,
             "A reduction that has waited this long is reported once on stderr: the ranks "
             "it waits for, what each of them waits in (a different compiled program is "
             "named as such) and where in the program the reductions were written; those "
             "ranks' errors then quote the report. 0: never."),
        Knob("HERRING_IDENTITY", "auto", _identity,
             "How the processes name a reduction alike. program: XLA's run id (the "
             "executable and its launch), which needs every process to compile the same "
             "executable, and fails a rank that ran a program more often than its peers "
             "naming both runs. launch: the instruction and how many launches of it came "
             "before, which holds where processes compile one program into differently "
             "tuned executables (XLA:CUDA's autotuning does); a rank whose first launches "
             "of a program skipped a reduction (a cond) then pairs it with its peers' "
             "first, and inlined copies of one jitted helper are told apart by their "
             "order in each process's executable. auto: program on XLA:CPU, launch on "
             "XLA:CUDA. Read at initialize(); it must be the same on every rank."),
        Knob("HERRING_MAX_POSTED", 0, _non_negative_int,
             "At most this many sends, and this many receives, handed to the libfabric "
             "provider at once; more wait in herring_jax's queue (posting never blocks). "
             "0: the provider's queue sizes, at most 8192 each."),
        Knob("HERRING_PROGRESS_SLICE_US", 100, _non_negative_int,
             "Time slice the transport's progress thread asks the scheduler for (Linux "
             "6.12+; older kernels ignore it), so that a message is handled promptly while "
             "the process's other threads keep the cores busy. 0: the kernel's default."),
        Knob("HERRING_HOST_STAGE", True, _bool,
             "1: processes of one host reduce through memory (process_vm_readv) and only "
             "each host's share crosses the network; 0: every process talks to every "
             "other over the transport. Rank 0's value holds for the whole job."),
        Knob("HERRING_HOST_DIRECT_BYTES", 32768, _non_negative_int,
             "A host-stage all-reduce on one host of at most this many bytes (all its "
             "buffers together) takes the direct path: each process reads every other's "
             "whole input and sums it itself, waiting for its peers once instead of twice "
             "(it pays for small buffers only, where the wait costs more than the bytes). "
             "0: never. Rank 0's value holds for the whole job."),
        Knob("HERRING_HOST_BOARD", True, _bool,
             "1: the host stage's steps (where inputs and result slices are) go through a "
             "shared-memory board per process with futex waits; 0: through transport "
             "messages. Rank 0's value holds for the whole job."),
        Knob("HERRING_SERVERS", 0, _non_negative_int,
             "Server-only processes of the job: processes that train nothing and only sum "
             "(`herring-jax launch --servers K` sets it; on a cluster set it on every worker "
             "and start K `herring-jax serve`, see docs/guides/servers.md). Rank 0 waits for "
             "them at initialize(). jax.process_count() stays the number of workers. Rank "
             "0's value holds for the whole job."),
        Knob("HERRING_SERVER_SHARE", None, _share,
             "The share (0 to 1) of each all-reduce buffer, and of each block (a worker's "
             "part) of a reduce-scatter or all-gather, that goes to the server-only "
             "processes; the rest goes to the workers' own server shards. Unset: splits "
             "that give every flow a worker sends the same bytes (n workers, k servers; "
             "docs/guides/servers.md): an all-reduce 2k / (n + 2k), or 1 where that moves "
             "fewer bytes per host, as for k >= n > 2 (n = 4: 1/3, 0.5, 0.6, 1 for k = 1, 2, "
             "3, 4); a block k / (n + k). Rank 0's value holds for the whole job."),
        Knob("HERRING_SERVER_MIN_BYTES", 4 << 20, _non_negative_int,
             "The smallest buffer of an all-reduce, reduce-scatter or all-gather, in bytes (as "
             "they travel: encoded, with a wire "
             "codec), that places parts on the server-only processes; smaller ones stay on "
             "the workers' own shards, where the servers' "
             "extra messages and processes cost more than the bytes they save (on 4 hosts of "
             "1 Gbit/s, servers paid from 4 MiB on; docs/guides/servers.md, \"When they "
             "pay\"). 0: every buffer. Rank 0's value holds for the whole job."),
        Knob("HERRING_SERVER_PORT", 0, _non_negative_int,
             "The TCP port on which rank 0 waits for the server-only processes (`herring-jax "
             "serve --coordinator HOST:PORT` connects there). 0: the jax.distributed "
             "coordinator's port + 1."),
        Knob("HERRING_TEST_SERVER_EXIT_S", None, _positive_float,
             "Tests only: a server-only process kills itself (SIGKILL) this many seconds "
             "after it starts serving."),
        Knob("HERRING_TEST_SERVER_KILL_AT_CHUNK", None, _positive_int,
             "Tests only: in a job's first run (HERRING_RESTART unset or 0), a server-only "
             "process kills itself (SIGKILL) once it has summed this many chunks: a point of "
             "the training that timing does not move, which a restart does not meet again."),
        Knob("HERRING_ALLOW_MEMORY_READS", True, _bool,
             "1: under Yama's kernel.yama.ptrace_scope 1, this process lets the other processes "
             "of its host read its memory for the host stage, by declaring their nearest "
             "common ancestor its tracer (any process of the user only where they share no "
             "ancestor but init; describe() says which), until shutdown(). 0: it declares "
             "nothing, and its host reduces over the transport."),
        Knob("HERRING_TEST_DENY_BOARDS", False, _bool,
             "Tests only: this process reports that it cannot map the other processes' "
             "host boards, so its host's steps go as messages."),
        Knob("HERRING_TEST_DENY_MEMORY_READS", False, _bool,
             "Tests only: this process reports that its memory cannot be read, so its "
             "host reduces over the transport."),
        Knob("HERRING_TEST_STALE_COPIES", False, _bool,
             "Tests only: before each data message, send a copy with another job's token, "
             "which the receiver must drop."),
        Knob("HERRING_TEST_EARLY_STRANGERS", False, _bool,
             "Tests only: at the start of every reduction over the transport, send each "
             "peer a full-size result with another job's token and garbage bytes, then "
             "wait 20 ms before sending the contributions; the receiver must drop them."),
        Knob("HERRING_TEST_GATHER_DELAY_MS", 0, _non_negative_int,
             "Tests only: each host-stage call of this process waits this many ms before "
             "reading the other processes' result slices (a slow reader)."),
        Knob("HERRING_TEST_READ_DELAY_MS", 0, _non_negative_int,
             "Tests only: each host-stage call of this process waits this many ms before "
             "reading the other processes' inputs (a slow reader of inputs)."),
        Knob("HERRING_TEST_ACTIVATE_DELAY_MS", 0, _non_negative_int,
             "Tests only: each reduction of this process waits this many ms between its "
             "check that the communicator is usable and the moment an abort can see it."),
        Knob("HERRING_TEST_FAULT", "", _test_fault,
             "Tests only: comma-separated faults, each of this process's first reduction that "
             "can have it: "
             "abort-at-start (fails at once, telling every rank), no-staging or no-posting "
             "(the host stage finds no memory for its staging, or no free board posting), "
             "withdraw-after-ready (the host stage fails after publishing its result slice "
             "without telling anyone, then overwrites its inputs), bad-alloc (std::bad_alloc "
             "once a reduction over the transport is under way), slow-server-threads (once the job "
             "has failed, the first task of this process's server threads starts 2 s late)."),
        Knob("HERRING_TEST_DEVICE_DOUBLE", False, _bool,
             "Tests only: reductions on CPU devices lower as on XLA:CUDA (a start and a "
             "done) to XLA:CUDA's handler code run against the CPU double of its device "
             "layer (copies on a stream thread of its own, events; xla_ffi/device_double.h) "
             "instead of herring_allreduce. Read when a reduction is lowered."),
        Knob("HERRING_TEST_DEVICE_FAULT", "", _device_fault,
             "Tests only: the CPU double's fault hook (HERRING_TEST_DEVICE_DOUBLE), "
             "comma-separated KIND:WAY:N[:MS] rules: the N-th copy (from 1, in enqueue order) "
             "of this process to the host (WAY host: the starts') or to the device (device: "
             "the dones') is delayed MS ms (delay), fails, its stream's error sticking (fail), "
             "or kills this process while in flight (kill). E.g. delay:host:2:1500."),
        Knob("HERRING_TEST_FORGE_AS", None, _non_negative_int,
             "Tests only: this process's first host-stage call sends every other rank an "
             "abort, and every other process of its host an arrive, forged to come from this "
             "rank; receivers must drop them (source checks) or never match them (directed "
             "receives)."),
        Knob("HERRING_TEST_PTRACE_SCOPE", None, int,
             "Tests only: behave as if kernel.yama.ptrace_scope had this value, recording the "
             "tracer declarations instead of making them (for kernels without Yama)."),
        Knob("HERRING_SPARSE_MAX_ROWS", None, _rows_or_share,
             "allreduce_gradients(sparse_rows=...) without sparse_max_rows: the most rows "
             "a process sends of each row-sparse leaf per step (the shapes are fixed when "
             "the step is traced), an integer, or a share of the leaf's rows with a point "
             "(0.02 = 2%). A step in which a process touched more reduces those leaves "
             "densely instead (the same bits). Unset: 1/16 of the rows. Read when the step "
             "is traced."),
        Knob("HERRING_TIMELINE", None, str,
             "Path of a Chrome trace (Perfetto, chrome://tracing) of this process's "
             "reductions: when XLA issued each, when herring's thread took it up, when it "
             "ended, with its bytes, name and call site. Each process writes its own file, "
             "PATH with {rank} replaced or with .rank<R> before the extension; "
             "`herring-jax timeline FILES -o OUT` merges them. Unset: no trace."),
        Knob("HERRING_FAST_EXIT", True, _bool,
             "1: an uncaught HerringError, and in a job of several processes any uncaught "
             "exception (after every other rank was told), ends the process at once (status "
             "1; by SIGINT, status 130, for a KeyboardInterrupt, as Python) instead of running "
             "exit handlers, which would wait up to 5 minutes in jax.distributed's shutdown "
             "for the other processes. The HERRING_TIMELINE trace is written first."),
        Knob("HERRING_VERBOSE_ERRORS", False, _bool,
             "1: an uncaught HerringError prints its whole Python traceback, through "
             "herring_jax's, jax's and jaxlib's own code. 0: only the program's own frames "
             "(the error's message says what failed, which rank and where the ranks were; "
             "herring's first stderr line on each rank says it too)."),
        Knob("HERRING_LAUNCH_GRACE_S", 10.0, _non_negative_float,
             "herring-jax launch: seconds between SIGTERM and SIGKILL when it stops a job "
             "after a rank failed (first giving the others up to 3 s to end by themselves) "
             "or at --timeout. After a stop signal to the launcher (Ctrl-C, SIGTERM, SIGHUP) "
             "it waits the larger of this and HERRING_PREEMPTION_GRACE_S + 2 s: 22 s with "
             "the defaults. A second signal ends the wait at once; a process that ignores "
             "SIGTERM gets SIGKILL at once. The launcher says when it waits."),
        Knob("HERRING_LAUNCH_KEEP_PREEMPTION", False, _bool,
             "Under herring-jax launch, initialize() gives SIGTERM its default action back, "
             "so that the launcher's SIGTERM ends a rank at once: jax.distributed's "
             "preemption notifier catches SIGTERM and lets the process run on. 1 keeps the "
             "notifier (for jax's preemption sync points). A SIGTERM handler installed from "
             "Python before initialize() is always kept."),
        Knob("HERRING_RESTART", 0, int,
             "Set by herring-jax launch --max-restarts: the number of the run (0 first, 1 "
             "after the first restart, ...); set it yourself under another supervisor if "
             "your program reads it."),
        Knob("HERRING_PREEMPTION_GRACE_S", 20.0, _positive_float,
             "herring_jax.catch_preemption / preemption_requested: seconds from the first "
             "SIGTERM within which the process saves at the step boundary every process "
             "agrees on and exits; past it, it says so and exits with status 1 (cloud "
             "notices give 30 s to 2 min). herring-jax launch waits this long plus 2 s "
             "(or HERRING_LAUNCH_GRACE_S, if longer) after forwarding a stop signal."),
        Knob("HERRING_INIT_TIMEOUT_S", 300.0, _positive_float,
             "How long initialize() waits for every process to publish its address."),
        Knob("HERRING_COORDINATOR_ADDRESS", None, str,
             "host:port of the jax.distributed coordinator (set by herring-jax launch)."),
        Knob("HERRING_NUM_PROCESSES", None, _positive_int,
             "Number of processes (set by herring-jax launch)."),
        Knob("HERRING_PROCESS_ID", None, int,
             "This process's rank (set by herring-jax launch)."),
        Knob("HERRING_LOCAL_RANK", None, _non_negative_int,
             "This process's index among the processes of its host (set by herring-jax "
             "launch: the rank; with --netns, its index in its simulated host, rank % "
             "--processes-per-host). herring_jax does not read it; it is for the program (a "
             "device or core per process)."),
        Knob("HERRING_FI_VARS_SET", None, str,
             "Set by herring_jax: the libfabric variables it set at import and their values "
             "(VAR=value;...), so that child processes recompute them; do not set it."),
        Knob("HERRING_BENCH_NETWORK", None, str,
             "Set by herring-jax bench for its workers: the network the run measures "
             "(loopback, or the simulated hosts and rates), recorded in its report; do not "
             "set it."),
        Knob("HERRING_BENCH_LOGDIR", None, str,
             "Set by herring-jax bench when mpirun starts its workers: the folder where ranks "
             "other than 0 write their output (shown if the run fails); do not set it."),
        Knob("HERRING_DEMO_PROCESSES", 4, _positive_int,
             "examples/run_demo.sh: the number of processes the demo trains on."),
        Knob("HERRING_DEMO_INSTALL", True, _bool,
             "examples/run_demo.sh: 0 skips `bash .ci/install.sh demo` (the installs and the "
             "build) before the training."),
    ]
}


def get(name: str) -> Any:
    """Returns the knob's value from the environment, or its default."""
    knob = KNOBS[name]
    text = os.environ.get(name)
    if text is None or (text == "" and knob.default is None):
        return knob.default
    try:
        return knob.parse(text)
    except ValueError as e:
        raise ValueError(f"{name}={text!r} is invalid: {e}. {knob.doc}") from None


def get_or(name: str, default: Any) -> Any:
    """The knob's value, or `default` where it has none (unset, no default)."""
    value = get(name)
    return default if value is None else value


def markdown_table() -> str:
    """The knob table as Markdown, for docs/guides/knobs.md (tests/test_docs.py)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for k in KNOBS.values():
        default = "unset" if k.default is None else repr(k.default)
        rows.append(f"| `{k.name}` | {default} | {k.doc} |")
    return "\n".join(rows)
