"""Process set-up: initialize() and shutdown().

initialize() joins (or starts) jax.distributed, opens this process's
libfabric endpoint, exchanges endpoint addresses and the job token through the
jax.distributed key-value store, and starts the server threads. Server-only
processes, which jax.distributed cannot hold, meet rank 0 through servers.py.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import secrets
import signal
import sys
import threading
import time

import jax

from herring_jax._src.process import addresses
from herring_jax._src.process import jax_compat
from herring_jax._src.process import joining
from herring_jax._src.process import knobs
from herring_jax._src.process import last_words
from herring_jax._src.process import servers as servers_lib
from herring_jax._src.process import timeline
from herring_jax._src.process import topology as topology_lib
from herring_jax._src.process import errors
from herring_jax._src.process.errors import (HerringError, as_herring_error,
                                             install_error_translation, install_excepthook)

# fabric_env.py, imported with the package, has said what to do if it is missing.
from herring_jax import _herring_ffi as _ext


@dataclasses.dataclass(frozen=True)
class _State:
    handle: int
    rank: int
    size: int
    provider: str
    generation: int
    args: tuple
    topology: topology_lib.Topology
    servers: tuple = (0, 0)  # rank 0's HERRING_SERVERS and HERRING_SERVER_MIN_BYTES


_lock = threading.Lock()
_state: _State | None = None
# Rank 0's watch on the server-only processes' connections (servers.py).
_server_watch = None
_generation = 0
_targets_registered = False
_exit_registered = False


def _register_targets() -> None:
    """Registers the handlers (and, first, the types they keep per-instruction
    state in: XLA refuses a handler whose state type it does not know). Runs
    after jax.distributed and the backend are up: before that, jax defers both
    and then applies the handlers first, which XLA refuses."""
    global _targets_registered
    # Every time: the handler finds its device's local index in this table,
    # by the number XLA:CPU's handler sees (DeviceOrdinal: the global id;
    # measured 0, 1, 2048, 2049 for two processes of two devices).
    # A process started with JAX_PLATFORMS=cuda has no CPU backend at all.
    _ext.set_local_devices("cpu", [d.id for d in _local_devices("cpu")])
    # The CUDA handler exists when the extension was built with a CUDA
    # toolkit; it is registered only where jax has CUDA devices.
    cuda = _ext.cuda_registrations() if _has_cuda() else {}
    # Before anything reducing compiles: each instruction takes its identity
    # when XLA instantiates it (xla_ffi/call_identity.cc).
    identity = knobs.get("HERRING_IDENTITY")
    for platform, default in (("cpu", "program"), ("cuda", "launch")):
        chosen = default if identity == "auto" else identity
        _ext.set_launch_identity(platform, chosen == "launch")
    # Tests: the fault hook of the CPU double (HERRING_TEST_DEVICE_DOUBLE).
    _ext.set_device_double_faults(knobs.get("HERRING_TEST_DEVICE_FAULT"))
    if cuda:
        # XLA:CUDA's DeviceOrdinal is the process-local ordinal, which PJRT's
        # GPU client takes from the device it runs on: local_hardware_id.
        _ext.set_local_devices(
            "cuda", [d.local_hardware_id for d in jax.local_devices(backend="cuda")])
    if _targets_registered:
        return
    for name, registration in _ext.type_registrations().items():
        jax.ffi.register_ffi_type(name, registration, platform="cpu")
    for name, bundle in _ext.registrations().items():
        jax.ffi.register_ffi_target(name, bundle, platform="cpu")
    if cuda:
        for name, registration in _ext.cuda_type_registrations().items():
            jax.ffi.register_ffi_type(name, registration, platform="CUDA")
        for name, bundle in cuda.items():
            jax.ffi.register_ffi_target(name, bundle, platform="CUDA")
    _targets_registered = True


def _local_device_numbers() -> dict[int, int]:
    """The number each local device's handler sees -> its local index (see
    _register_targets: the global id on XLA:CPU, local_hardware_id on CUDA)."""
    numbers = {}
    for index, d in enumerate(jax.local_devices()):
        numbers[d.id if d.platform == "cpu" else d.local_hardware_id] = index
    return numbers


def _local_devices(platform: str) -> list:
    """This process's devices of `platform`; none where jax has no such
    backend (JAX_PLATFORMS=cuda leaves out the CPU one)."""
    try:
        return jax.local_devices(backend=platform)
    except RuntimeError:
        return []


def _has_cuda() -> bool:
    return bool(_local_devices("cuda"))


def cuda_handler_built() -> bool:
    """Whether this build of herring_jax includes the CUDA platform handler."""
    return bool(_ext.cuda_registrations())


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Starts herring_jax in this process. Idempotent.

    Calls ``jax.distributed.initialize`` unless it already ran (arguments left
    as None come from HERRING_COORDINATOR_ADDRESS / HERRING_NUM_PROCESSES /
    HERRING_PROCESS_ID, set by ``herring-jax launch``, or from jax's own
    cluster detection), then connects every process's server shard. It also
    installs a ``sys.excepthook`` under which an uncaught failed reduction from
    inside a jitted function is reported as HerringError (and, with
    HERRING_FAST_EXIT, ends the process at once).

    Args:
      coordinator_address: ``host:port`` of the jax.distributed coordinator.
      num_processes: number of processes in the job.
      process_id: this process's rank.

    Raises:
      ValueError: a second call with different arguments.
      HerringError: the transport could not be opened or a peer did not
        publish its address within HERRING_INIT_TIMEOUT_S.

    Examples:
      >>> import herring_jax
      >>> herring_jax.initialize()  # doctest: +SKIP
    """
    global _state, _generation, _server_watch
    args = (coordinator_address, num_processes, process_id)
    with _lock:
        if _state is not None:
            if any(a is not None for a in args) and args != _state.args:
                raise ValueError(
                    f"herring_jax is already initialized with {_state.args}; a second "
                    f"initialize() with different arguments {args} is not allowed. "
                    "Call herring_jax.shutdown() first.")
            return
        coordinator_address = coordinator_address or knobs.get("HERRING_COORDINATOR_ADDRESS")
        if num_processes is None:
            num_processes = knobs.get("HERRING_NUM_PROCESSES")
        if process_id is None:
            process_id = knobs.get("HERRING_PROCESS_ID")
        if not jax.distributed.is_initialized():
            joining.join_distributed(coordinator_address, num_processes, process_id)
            _default_sigterm_under_launcher()
        client = jax_compat.distributed_client()
        rank, size = jax.process_index(), jax.process_count()
        joining.turn_off_persistent_cache(rank, size)
        if client is None:
            raise HerringError("jax.distributed has no client; cannot exchange addresses")

        _generation += 1
        prefix = f"herring_jax/{_generation}"
        timeout_ms = int(knobs.get("HERRING_INIT_TIMEOUT_S") * 1000)
        try:
            if rank == 0:
                client.key_value_set(f"{prefix}/token", str(secrets.randbits(63) | 1))
                # Every process must plan groups alike: rank 0's setting holds.
                client.key_value_set(f"{prefix}/host_stage",
                                     "1" if knobs.get("HERRING_HOST_STAGE") else "0")
                client.key_value_set(f"{prefix}/host_board",
                                     "1" if knobs.get("HERRING_HOST_BOARD") else "0")
                client.key_value_set(f"{prefix}/host_direct_bytes",
                                     str(knobs.get("HERRING_HOST_DIRECT_BYTES")))
                # Chunks must be cut alike too: the wire checks each one.
                client.key_value_set(f"{prefix}/chunk_bytes",
                                     f'{knobs.get("HERRING_CHUNK_BYTES")} '
                                     f'{knobs.get("HERRING_MIN_CHUNK_BYTES")}')
            token = int(client.blocking_key_value_get(f"{prefix}/token", timeout_ms))
            host_stage = client.blocking_key_value_get(f"{prefix}/host_stage", timeout_ms) == "1"
            host_board = client.blocking_key_value_get(f"{prefix}/host_board", timeout_ms) == "1"
            host_direct_bytes = int(client.blocking_key_value_get(f"{prefix}/host_direct_bytes",
                                                                  timeout_ms))
            chunk_bytes, min_chunk_bytes = map(int, client.blocking_key_value_get(
                f"{prefix}/chunk_bytes", timeout_ms).split())
            # Server-only processes are ranks size .. size + servers - 1 of
            # herring's communicator, outside jax.distributed (servers.py).
            num_servers, server_share, server_min_bytes = servers_lib.job_servers(
                client, prefix, rank, timeout_ms)
            coordinator = coordinator_address or getattr(client, "coordinator_address", None)
            rendezvous = (servers_lib.open_rendezvous(num_servers, coordinator)
                          if rank == 0 and num_servers else None)

            provider = knobs.get("HERRING_FI_PROVIDER")
            interface = addresses.fabric_interface(provider, coordinator)
            handle = _ext.create_communicator(
                rank, size + num_servers, token, provider, interface, knobs.get("HERRING_FI_FORCE_MR"),
                chunk_bytes, knobs.get("HERRING_SERVER_THREADS"),
                knobs.get("HERRING_TIMEOUT_S"), knobs.get_or("HERRING_HEARTBEAT_S", -1.0),
                knobs.get("HERRING_PEER_TIMEOUT_S"), knobs.get("HERRING_MAX_POSTED"),
                knobs.get("HERRING_TEST_STALE_COPIES"),
                knobs.get("HERRING_TEST_GATHER_DELAY_MS"),
                knobs.get("HERRING_TEST_EARLY_STRANGERS"),
                knobs.get("HERRING_PROGRESS_SLICE_US"), knobs.get("HERRING_STALL_S"),
                knobs.get("HERRING_CUDA_DONE_GRACE_S"),
                knobs.get("HERRING_TEST_FAULT"),
                knobs.get("HERRING_TEST_READ_DELAY_MS"),
                knobs.get("HERRING_TEST_ACTIVATE_DELAY_MS"),
                knobs.get_or("HERRING_TEST_FORGE_AS", -1), host_direct_bytes,
                min_chunk_bytes, size if num_servers else 0, server_share, server_min_bytes)
            try:
                client.key_value_set_bytes(f"{prefix}/addr/{rank}", _ext.address(handle))
                if rendezvous is not None:
                    settings = {
                        "size": size + num_servers, "workers": size, "token": token,
                        "provider": provider, "chunk_bytes": chunk_bytes,
                        "min_chunk_bytes": min_chunk_bytes,
                        "timeout_s": knobs.get("HERRING_TIMEOUT_S"),
                        "heartbeat_s": knobs.get_or("HERRING_HEARTBEAT_S", -1.0),
                        "peer_timeout_s": knobs.get("HERRING_PEER_TIMEOUT_S"),
                        "server_share": server_share}
                    servers_lib.publish(client, prefix, size, rendezvous.accept(
                        settings, size, knobs.get("HERRING_INIT_TIMEOUT_S")))
                topology = topology_lib.exchange(
                    client, prefix, rank, size, timeout_ms, _ext, host_stage,
                    deny_reads=knobs.get("HERRING_TEST_DENY_MEMORY_READS"),
                    handle=handle, boards=host_board,
                    deny_boards=knobs.get("HERRING_TEST_DENY_BOARDS"),
                    refuse_reads=not knobs.get("HERRING_ALLOW_MEMORY_READS"))
                topology = dataclasses.replace(topology, direct_bytes=host_direct_bytes)
                if num_servers:
                    topology = servers_lib.with_servers(topology, client, prefix, timeout_ms,
                                                        size, num_servers)
                _ext.set_topology(handle, topology.host_of, topology.pid_of,
                                  topology.memory_shared, topology.board_shared)
                addrs = [client.blocking_key_value_get_bytes(f"{prefix}/addr/{r}", timeout_ms)
                         for r in range(size + num_servers)]
                _ext.connect(handle, addrs)
                if rendezvous is not None:
                    rendezvous.finish(addrs)
                    # A server's end closes its rendezvous connection: the
                    # job fails at once, not after HERRING_PEER_TIMEOUT_S.
                    rendezvous.watch(size, functools.partial(_server_gone, handle))
                    _server_watch = rendezvous
            except BaseException:
                if rendezvous is not None:
                    rendezvous.close()
                _ext.destroy(handle)
                topology_lib.take_back_ptracer(_ext)
                raise
        except HerringError:
            raise
        except Exception as e:
            raise HerringError(f"herring_jax.initialize() failed on rank {rank} of {size}: {e}") from e
        if "ofi_rxd" in provider and rank == 0:
            # Seen on this project's machines (libfabric 1.17, simulated
            # hosts with shaped links): ofi_rxd completed a 1 MiB message
            # with bytes missing; herring then fails the job, never sums it.
            print(f"herring_jax: provider {provider}: ofi_rxd has lost parts of large "
                  "messages when the network drops packets under load (the job then fails "
                  "with 'the provider lost data'); prefer tcp;ofi_rxm, or efa on AWS",
                  file=sys.stderr, flush=True)
        _register_targets()
        _state = _State(handle, rank, size, provider, _generation, args, topology,
                        (num_servers, server_min_bytes))
        errors.set_abort_peers(_abort_peers)
        errors.set_before_exit(_before_fast_exit)
        install_error_translation()
        install_excepthook(knobs.get("HERRING_FAST_EXIT"))
        _shutdown_at_exit()
        timeline.start(rank, size, f"{_ext.describe(handle)}; {topology.describe(rank)}",
                       _local_device_numbers())


def _under_launcher() -> bool:
    """Whether `herring-jax launch` (or its environment) started this process."""
    return os.environ.get("HERRING_NUM_PROCESSES") is not None


def _default_sigterm_under_launcher() -> None:
    """Under `herring-jax launch`, lets SIGTERM end the process again.

    jax.distributed.initialize() installs its preemption notifier, a C-level
    SIGTERM handler that only records the signal for jax's preemption sync
    points: the process runs on, and a launcher stopping a failed job waited
    its whole grace period for every rank. Python still reports SIGTERM's
    handler as the default then (it did not install one), so a handler of the
    user's own, installed from Python before initialize(), is left alone.
    HERRING_LAUNCH_KEEP_PREEMPTION=1 keeps jax's notifier.
    """
    if (not _under_launcher() or knobs.get("HERRING_LAUNCH_KEEP_PREEMPTION")
            or threading.current_thread() is not threading.main_thread()):
        return
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _abort_peers(why: str) -> bool:
    """Tells every other rank that this process is failing (errors.py's hook);
    whether there were any."""
    current = _state
    if current is None or current.size < 2:
        return False
    _ext.abort(current.handle, why, 2.0)
    return True


def _shutdown_at_exit() -> None:
    """Registers shutdown() to run at interpreter exit (once per process),
    before jax's own exit handler: atexit runs handlers last-in first-out."""
    global _exit_registered
    if not _exit_registered:
        atexit.register(_exit_handler)
        _exit_registered = True


def _exit_handler() -> None:
    try:
        shutdown()
    except BaseException as e:  # noqa: BLE001 - the program is ending; say why and fail
        print(f"herring_jax: at exit: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if knobs.get("HERRING_FAST_EXIT"):
            errors.exit_now(e)


# How long a fast exit waits for the reductions in flight, which the abort
# has failed, to end and so be in the timeline.
_EXIT_DRAIN_S = 0.5


def _before_fast_exit() -> None:
    """Before errors.exit_now skips the exit handlers: the timeline's last
    events written, the failed reductions' slices among them; then, this
    rank's report being printed, process 0 outlives the others' (last_words)."""
    current = _state
    if current is not None and timeline.writing():
        deadline = time.monotonic() + _EXIT_DRAIN_S
        while (time.monotonic() < deadline
               and _ext.stats(current.handle)["batches_in_flight"]):
            time.sleep(0.01)
    timeline.flush_before_exit()
    if current is not None and current.size > 1:
        last_words.say_ending(current.generation, current.rank)
        last_words.outlive_the_others(current.generation, current.rank, current.size,
                                      current.topology)


def _server_gone(handle: int, rank: int, how: str) -> None:
    """Rank 0: server-only process `rank` is gone (servers.Rendezvous.watch)."""
    with _lock:
        if _state is not None and _state.handle == handle:
            _ext.server_gone(handle, rank, how)


def _stop_server_watch() -> None:
    global _server_watch
    if _server_watch is not None:
        _server_watch.close()
        _server_watch = None


def shutdown() -> None:
    """Waits for this process's work in flight, then stops herring_jax here.

    jax dispatches jitted steps asynchronously: a loop of steps returns
    before they have run, and their reductions are still to come. shutdown()
    first waits for every computation whose results are still alive, so that
    a step that reduces can finish with the other processes; then it stops
    the server threads, tells the other processes that this one has left
    (one that still waits for it fails at once, naming this rank), closes the
    endpoint, and takes back the permission to read this process's memory
    that initialize() gave the other processes of its host (Yama's ptrace
    scope 1). It also runs at interpreter exit. Safe to call twice.

    Compiled functions that reduce through herring_jax are dropped from jax's
    caches, since they refer to the closed communicator.

    Raises:
      HerringError: a computation still in flight failed (a peer failed or
        left); herring_jax is shut down all the same.
    """
    global _state
    if _state is None:
        return
    failure = None
    try:
        jax.block_until_ready(jax.live_arrays())
    except Exception as e:  # noqa: BLE001 - raised after the shutdown below
        failure = e
    with _lock:
        if _state is None:
            return
        _stop_server_watch()  # the servers end once the workers have left
        _ext.destroy(_state.handle)
        # Nobody reads this process's memory any more (the communicator's
        # destructor waited for the last readers of its slices).
        topology_lib.take_back_ptracer(_ext)
        _state = None
    timeline.flush()  # every reduction has ended: the trace is complete
    jax.clear_caches()
    if failure is not None:
        raise as_herring_error(failure)


def current() -> _State | None:
    return _state  # None before initialize() and after shutdown()


def state() -> _State:
    """The live state; raises HerringError before initialize()."""
    current = _state
    if current is None:
        raise HerringError(
            "herring_jax is not initialized in this process: call herring_jax.initialize() "
            "first (under `herring-jax launch` it needs no arguments)")
    return current


def describe() -> str:
    """Rank, size, transport and host, e.g. 'rank 0 of 4 over tcp;ofi_rxm (...),
    heartbeats every 1 s; host 0 of 2, 2 processes on it, host stage through
    memory'."""
    current = state()
    return f"{_ext.describe(current.handle)}; {current.topology.describe(current.rank)}"


def job_servers() -> tuple[int, int]:
    """(server-only processes, the smallest buffer put on them) as rank 0 set them."""
    return _state.servers if _state is not None else (0, 0)


def stats() -> dict:
    """Counters of this process's communicator since ``initialize()``.

    Among them ``bytes_reduced`` (the whole size of every buffer reduced, as
    the program holds it: a reduce-scatter and an all-gather of B bytes add B
    each, as an all-reduce does) and ``bytes_sent`` (what this process sent
    over the transport, headers included). The Timeline guide's "Counters"
    defines each one.

    Returns:
      A dict of counter names to ints.
    """
    return dict(_ext.stats(state().handle))


def note_call_site(key: int, slot: int, site: str) -> None:
    """Where the reduction of `key` at `slot` was written (lowering.py)."""
    _ext.note_call_site(state().handle, key, slot, site)


def take_timeline() -> list[dict]:
    """This process's reductions since the last call, oldest first: slot,
    device, bytes and the CLOCK_MONOTONIC nanoseconds (time.monotonic_ns) at
    which XLA issued each, herring's thread took it up, and it ended (and
    key, the reduction's identity). Also with HERRING_TIMELINE set, which
    takes the engine's events every second for the trace."""
    return timeline.take()


def _check_started(api: str) -> None:
    """Under the launcher, jax answers one process of rank 0 until
    jax.distributed is up: a rank that asks first would act as rank 0 alone."""
    if _state is None and _under_launcher() and not jax.distributed.is_initialized():
        raise HerringError(
            f"herring_jax.{api}() was called before herring_jax.initialize(): under "
            "herring-jax launch every process would answer as rank 0 of 1. Call "
            "herring_jax.initialize() first.")


def process_count() -> int:
    """The number of processes in the job (after ``initialize()``)."""
    _check_started("process_count")
    return jax.process_count()


def process_index() -> int:
    """This process's rank (after ``initialize()``)."""
    _check_started("process_index")
    return jax.process_index()
