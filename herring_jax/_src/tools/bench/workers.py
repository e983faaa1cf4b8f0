"""Starting the workers of `herring-jax bench` under herring-jax launch, and
the runner that the mpirun start (mpirun.py) shares."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque


def launch(args, worker: list[str], env: dict) -> int:
    """Starts the workers under herring-jax launch and shows rank 0's output."""
    launcher = [sys.executable, "-m", "herring_jax.launch", "-n", str(args.num_processes),
                "--timeout", str(args.timeout)]
    if getattr(args, "netns", False):
        launcher += ["--netns", "--processes-per-host", str(args.processes_per_host)]
        for flag, value in (("--host-rate", args.host_rate), ("--flow-rate", args.flow_rate)):
            if value:
                launcher += [flag, value]
    if getattr(args, "servers", 0):
        launcher += ["--servers", str(args.servers)]
    launcher += ["--", *worker]
    return run_workers(launcher, env, None,
                       lambda line: line[len("[rank 0] "):]
                       if line.startswith("[rank 0] ") else None)


def run_workers(command: list[str], env: dict, timeout: float | None, rank0) -> int:
    """Runs the workers' launcher, showing rank 0's lines (rank0(line) -> text
    or None); the other lines are shown only on failure."""
    others: deque[str] = deque(maxlen=100)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, env=env, cwd=tmp, stdout=subprocess.PIPE,
                                stderr=err, text=True, start_new_session=True)
        timer = None
        if timeout:
            timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
            timer.start()
        try:
            for line in proc.stdout:
                text = rank0(line)
                # gloo prints its connection chatter on stdout.
                if text is not None and not text.startswith("[Gloo]"):
                    sys.stdout.write(text if text.endswith("\n") else text + "\n")
                    sys.stdout.flush()
                else:
                    others.append(line)
            code = proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops every worker
            proc.wait()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if code != 0:
            err.seek(0)
            sys.stderr.write("".join(others) + err.read()[-8000:])
            print(f"herring-jax bench: workers failed (exit {code})", file=sys.stderr)
    return code
