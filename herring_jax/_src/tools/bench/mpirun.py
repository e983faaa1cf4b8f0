"""Starting the workers of `herring-jax bench` with mpirun, which the MPI
peers need (every peer still runs in the same processes)."""

from __future__ import annotations

import os
import sys
import tempfile

from herring_jax._src.tools.bench.workers import run_workers
from herring_jax._src.launcher.launch import free_port


def launch_mpi(args, worker: list[str], env: dict) -> int:
    """Starts the workers with mpirun on loopback; Open MPI picks its
    transports itself unless --mpi-btl says."""
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
        code = run_workers(command + worker, env, args.timeout, lambda line: line)
        if code != 0:
            for name in sorted(os.listdir(logs)):
                with open(os.path.join(logs, name), errors="replace") as f:
                    sys.stderr.write(f"--- {name} ---\n{f.read()[-4000:]}")
    return code
