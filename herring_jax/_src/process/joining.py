"""Joining a job: waiting for the coordinator, jax.distributed's start (or a
job of one process where nothing says there are others), and what of jax's
own set-up a job of several processes must turn off. runtime.initialize()
calls these before it opens herring's endpoint (addresses.py says which
local address that endpoint binds)."""

from __future__ import annotations

import os
import socket
import sys
import time

import jax
from jax.experimental.compilation_cache import compilation_cache

from herring_jax._src.process import knobs
from herring_jax._src.process import ports
from herring_jax._src.process.addresses import split_address
from herring_jax._src.process.errors import HerringError


def wait_for_coordinator(coordinator: str, timeout_s: float) -> None:
    """Returns once the coordinator's port accepts connections (or after
    timeout_s; jax.distributed then reports what is wrong itself).

    The processes of a job start together, and the others usually ask before
    process 0's coordination service listens: jax's client then waits out
    gRPC's reconnect backoff, a whole second, before it asks again. A plain
    TCP connect every 10 ms costs nothing and lets initialize() go on as soon
    as the service is up."""
    host, port = split_address(coordinator)
    try:
        address = (host, int(port))
    except ValueError:
        return  # not host:port; jax.distributed names the problem
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(address, timeout=1.0):
                return
        except OSError:
            time.sleep(0.01)


def join_distributed(coordinator_address, num_processes, process_id) -> None:
    """jax.distributed.initialize(), or a job of this one process where
    nothing says there are others (plain ``python train.py``)."""
    if coordinator_address and process_id not in (None, 0):
        wait_for_coordinator(coordinator_address, knobs.get("HERRING_INIT_TIMEOUT_S"))
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address,
                                   num_processes=num_processes, process_id=process_id)
        return
    except ValueError as e:
        # No launcher and no cluster jax recognises (SLURM, Open MPI, ...).
        if coordinator_address or num_processes or "coordinator_address" not in str(e):
            raise HerringError(f"jax.distributed.initialize() failed: {e}") from e
    except RuntimeError as e:
        raise HerringError(
            f"jax.distributed.initialize() failed: {e} Call herring_jax.initialize() "
            "at the start of the program, before any JAX computation.") from e
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
    print(f"herring_jax: no launcher or cluster found, so this runs as a job of one process; "
          f"for N processes on this machine: herring-jax launch -n N -- python {script}",
          file=sys.stderr, flush=True)
    try:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{ports.free_port()}",
                                   num_processes=1, process_id=0)
    except RuntimeError as e:
        raise HerringError(f"jax.distributed.initialize() failed: {e}") from e


def turn_off_persistent_cache(rank: int, size: int) -> None:
    """Turns jax's persistent compilation cache off in a job of several
    processes, saying so once.

    jax writes the cache from process 0 only, and its entries are per
    process (they name the devices), so on a rerun process 0 loads its
    reducing programs from the cache while the others compile theirs. A
    loaded program gets other run ids than a compiled one (XLA's run id
    derives from the executable's fingerprint), and nothing would pair the
    processes' reductions: measured, the first step stalled until
    HERRING_TIMEOUT_S ("Rank 1 runs a different compiled program").
    """
    if size < 2 or not getattr(jax.config, "jax_compilation_cache_dir", None):
        return
    if not getattr(jax.config, "jax_enable_compilation_cache", True):
        return
    jax.config.update("jax_enable_compilation_cache", False)
    # It decides once, at the first compile, whether the cache is in use.
    compilation_cache.reset_cache()
    if rank == 0:
        print(f"herring_jax: jax's persistent compilation cache (jax_compilation_cache_dir="
              f"{jax.config.jax_compilation_cache_dir}) is off for this job of {size} "
              "processes: jax writes it from process 0 only, and a program process 0 loads "
              "from it runs under other run ids than the ones the other processes compile, "
              "so their reductions would never pair", file=sys.stderr, flush=True)
