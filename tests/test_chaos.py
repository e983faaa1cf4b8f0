"""Chaos: one of 4 processes is SIGKILLed at a random moment while they reduce;
every survivor must exit with HerringError naming the killed rank, within the
peer timeout plus slack, and never return a wrong sum.

The processes are started directly (the environment `herring-jax launch`
would give them), not through the launcher, which would stop the survivors
itself as soon as one rank dies: here herring_jax's own detection must do it.
Rank 0 is never the victim: it hosts jax.distributed's coordinator, whose loss
ends the other processes through jax itself.

The partition test does the same in the simulated network (one network
namespace per process, herring_jax/_src/launcher/netns.py): one host's link to the
bridge goes down while its process lives on.

CI runs 3 kills and 1 partition; HERRING_LONG_TESTS=1 runs 20 and 5; the
sanitizer jobs (.ci/sanitizers.sh) run 1 kill.
"""

import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from herring_jax._src.launcher.launch import child_env, free_port
from herring_jax._src.launcher.netns import SimulatedNetwork

WORKER = Path(__file__).resolve().parent / "workers" / "chaos_worker.py"
LONG = os.environ.get("HERRING_LONG_TESTS") == "1"
PEER_TIMEOUT_S = 3.0
SLACK_S = 40.0  # 4 processes on 2 shared cores
# Short mode under .ci/sanitizers.sh (HERRING_SANITIZER set): one kill.
SANITIZER = os.environ.get("HERRING_SANITIZER")
KILLS, PARTITIONS = (20, 5) if LONG else (1, 1) if SANITIZER else (3, 1)
# What one trial may take at most: 4 processes starting on 2 shared cores,
# then each of the 3 survivors (and the cut-off victim) within the deadline
# _trial gives it. The long runs' pytest timeout (tests/conftest.py) is the
# sum over their trials.
TRIAL_MAX_S = 120 + 4 * (PEER_TIMEOUT_S + SLACK_S)


def _trial(rng: random.Random, net: SimulatedNetwork | None = None,
           env: dict[str, str] | None = None) -> tuple[int, list[float]]:
    """One fault: a random rank of 1..3 is SIGKILLed, or with `net`, cut off
    the network (its link to the bridge goes down). Returns the victim and
    the seconds until each survivor exited. `env`: more variables for every
    rank."""
    port = 29400 if net else free_port()
    base = dict(os.environ, JAX_PLATFORMS="cpu", HERRING_TIMEOUT_S="120",
                HERRING_PEER_TIMEOUT_S=str(PEER_TIMEOUT_S), **(env or {}))
    base.pop("XLA_FLAGS", None)
    command = [sys.executable, "-P", str(WORKER)]
    procs = [subprocess.Popen(net.wrap(r, command) if net else command,
                              env=child_env(base, r, 4, port, None,
                                            net.address(0) if net else "127.0.0.1"),
                              cwd=WORKER.parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in range(4)]
    outs, stacks = {}, {}
    try:
        for p in procs:  # wait until every rank reduces
            line = p.stdout.readline()
            while line and not line.startswith("CHAOS_READY"):
                line = p.stdout.readline()
            assert line, "a worker exited before reducing"
        time.sleep(rng.uniform(0.2, 3.0))
        victim = rng.randint(1, 3)
        if net:
            net.set_link(victim, up=False)
        else:
            os.kill(procs[victim].pid, signal.SIGKILL)
        fault_at = time.monotonic()
        detect = {}
        # Rank 0 last: it hosts jax.distributed's coordinator and, once it
        # exits, jax terminates every process still running. The worker keeps
        # it alive after its error until its stdin is closed.
        for r in [r for r in (1, 2, 3) if r != victim] + [0]:
            p = procs[r]
            try:  # communicate() closes stdin first, which lets rank 0 go
                outs[r], _ = p.communicate(timeout=PEER_TIMEOUT_S + SLACK_S)
            except subprocess.TimeoutExpired:
                stacks[r] = _native_stacks(p.pid)
                outs[r] = f"<still running {PEER_TIMEOUT_S + SLACK_S:.0f} s after the fault>"
            detect[r] = time.monotonic() - fault_at
        for r, out in outs.items():
            context = _context(victim, outs, stacks)
            assert "CHAOS_WRONG" not in out, context
            assert procs[r].returncode == 3, f"rank {r} exited {procs[r].returncode}\n{context}"
            m = re.search(r"CHAOS_ERROR ([\d.]+) (.*)", out)
            assert m, context
            # The victim is named, by the detecting rank or in its abort.
            assert f"rank {victim}" in m.group(2), f"rank {r} does not name {victim}\n{context}"
        if net:
            # The cut-off rank hears no one: it fails too (its own
            # HerringError, or jax's when the coordinator is gone), and
            # never with a wrong sum.
            out, _ = procs[victim].communicate(timeout=PEER_TIMEOUT_S + SLACK_S)
            assert procs[victim].returncode != 0 and "CHAOS_WRONG" not in out, out[-3000:]
        return victim, [detect[r] for r in sorted(detect)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _native_stacks(pid: int) -> str:
    """Every thread's native stack of a hung process, where gdb is installed."""
    if shutil.which("gdb") is None:
        return "(install gdb to see where it hangs)"
    r = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 25"],
                       capture_output=True, text=True, timeout=120)
    # The main thread and herring_jax's own threads (or an XLA thread
    # inside herring_jax's handler); jax's idle pools say nothing.
    threads = r.stdout.split("\nThread ")
    return "\n".join("Thread " + t for t in threads[1:]
                     if t.startswith("1 ") or "herring" in t or "libfabric" in t)


def _context(victim: int, outs: dict[int, str], stacks: dict[int, str]) -> str:
    """Every survivor's output (and a hung one's stacks): a failure that explains itself."""
    return f"victim rank {victim}\n" + "".join(
        f"--- rank {r} ---\n{out[-4000:]}\n{stacks.get(r, '')}\n"
        for r, out in sorted(outs.items()))


@pytest.mark.long_timeout(KILLS * TRIAL_MAX_S)
def test_killed_peer_fails_every_survivor_with_herring_error():
    rng = random.Random(1234)
    trials = KILLS
    all_detect = []
    for t in range(trials):
        victim, detect = _trial(rng)
        all_detect += detect
        print(f"trial {t}: killed rank {victim}, survivors exited after "
              f"{', '.join(f'{d:.1f}' for d in detect)} s")
    print(f"{trials} kills, {len(all_detect)} survivors failed with HerringError, "
          f"time to exit min/median/max {min(all_detect):.1f}/"
          f"{statistics.median(all_detect):.1f}/{max(all_detect):.1f} s, wrong results 0")


@pytest.mark.long_timeout(TRIAL_MAX_S)
def test_killed_peer_over_shm_without_heartbeats_fails_every_survivor_long_before_the_timeout():
    """Over shm no heartbeats flow (they are off there by default), and on
    one host the reductions' steps go through the shared-memory boards: the
    survivors must notice the killed process itself while they wait on the
    boards (it never posts), not after HERRING_TIMEOUT_S (120 s here; each
    survivor gets PEER_TIMEOUT_S + SLACK_S)."""
    victim, detect = _trial(random.Random(99), env={"HERRING_FI_PROVIDER": "shm"})
    print(f"shm: killed rank {victim}, survivors exited after "
          f"{', '.join(f'{d:.1f}' for d in detect)} s")


@pytest.mark.long_timeout(PARTITIONS * TRIAL_MAX_S)
def test_partitioned_host_fails_every_other_host_with_herring_error():
    """Issue 5's partition: 4 hosts in the simulated network; one host's
    link goes down (the process lives on, unreachable)."""
    rng = random.Random(4321)
    trials = PARTITIONS
    all_detect = []
    for t in range(trials):
        with SimulatedNetwork(4) as net:
            victim, detect = _trial(rng, net)
        all_detect += detect
        print(f"partition {t}: cut off rank {victim}, the others exited after "
              f"{', '.join(f'{d:.1f}' for d in detect)} s")
