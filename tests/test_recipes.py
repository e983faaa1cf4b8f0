"""The recipes of docs/guides/launching.md for starting a job without `herring-jax launch`:
herring_jax.initialize() joins jax.distributed, which finds its processes
under Open MPI's mpirun and under SLURM's srun (here: srun's environment,
set by hand), or takes them from HERRING_* variables (Kubernetes and any
other scheduler)."""

import os
import re
import subprocess
import sys

from herring_jax._src.launcher.launch import free_port
from multiproc import WORKERS

SCRIPT = str(WORKERS / "recipe_worker.py")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HERRING_", "SLURM_", "OMPI_", "PMIX_", "JAX_COORD"))}
    env.update(JAX_PLATFORMS="cpu", HERRING_TIMEOUT_S="60", **extra)
    return env


def _check(outputs, n):
    # Found anywhere, not per line: mpirun forwards each rank's stdout in its
    # own chunks, and one rank's line can arrive with another's newline.
    ranks = sorted(m.group(0) for out in outputs
                   for m in re.finditer(r"recipe rank \d+ of \d+: [0-9.]+", out))
    expected = float(sum(range(1, n + 1)))
    assert ranks == [f"recipe rank {r} of {n}: {expected}" for r in range(n)], outputs


def _run_each(envs: list[dict]) -> list[str]:
    """The job's script once per environment, all at once; their outputs."""
    procs = [subprocess.Popen([sys.executable, "-P", SCRIPT], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for env in envs]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, out + err
        outs.append(out)
    return outs


def test_mpirun():
    proc = subprocess.run(["mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe",
                           "-x", "JAX_PLATFORMS", sys.executable, "-P", SCRIPT],
                          env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check([proc.stdout], 2)


def test_srun_environment():
    # What srun sets for 2 tasks on one node; jax.distributed derives the
    # coordinator (first node, a port from the job id) and the ranks from it.
    _check(_run_each([_env(SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_PROCID=str(r),
                           SLURM_LOCALID=str(r), SLURM_STEP_NODELIST="localhost",
                           SLURM_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="2")
                      for r in range(2)]), 2)


def test_explicit_environment_without_the_launcher():
    # A Kubernetes StatefulSet (or any scheduler) sets these from the pod's
    # ordinal and a headless service's name; here, 3 processes on loopback.
    port = free_port()
    _check(_run_each([_env(HERRING_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                           HERRING_NUM_PROCESSES="3", HERRING_PROCESS_ID=str(r))
                      for r in range(3)]), 3)
