"""Chaos: one of 4 processes is SIGKILLed at a random moment while they reduce;
every survivor must exit with HerringError naming the killed rank, within the
peer timeout plus slack, and never return a wrong sum.

The processes are started directly (the environment `herring-jax launch`
would give them), not through the launcher, which would stop the survivors
itself as soon as one rank dies: here herring_jax's own detection must do it.
Rank 0 is never the victim: it hosts jax.distributed's coordinator, whose loss
ends the other processes through jax itself.

CI runs 3 kills; HERRING_LONG_TESTS=1 runs 20 and prints the figures.
"""

import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from herring_jax._src.launch import child_env, free_port

WORKER = Path(__file__).resolve().parent / "workers" / "chaos_worker.py"
LONG = os.environ.get("HERRING_LONG_TESTS") == "1"
PEER_TIMEOUT_S = 3.0
SLACK_S = 40.0  # 4 processes on 2 shared cores; rank 0 lingers 8 s


def _trial(rng: random.Random) -> tuple[int, list[float]]:
    port = free_port()
    base = dict(os.environ, JAX_PLATFORMS="cpu", HERRING_TIMEOUT_S="120",
                HERRING_PEER_TIMEOUT_S=str(PEER_TIMEOUT_S))
    base.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(WORKER)], env=child_env(base, r, 4, port),
                              cwd=WORKER.parent, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in range(4)]
    try:
        for p in procs:  # wait until every rank reduces
            line = p.stdout.readline()
            while line and not line.startswith("CHAOS_READY"):
                line = p.stdout.readline()
            assert line, "a worker exited before reducing"
        time.sleep(rng.uniform(0.2, 3.0))
        victim = rng.randint(1, 3)
        os.kill(procs[victim].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        detect = []
        for r, p in enumerate(procs):
            if r == victim:
                p.wait(timeout=10)
                continue
            out, _ = p.communicate(timeout=PEER_TIMEOUT_S + SLACK_S)
            elapsed = time.monotonic() - killed_at
            assert "CHAOS_WRONG" not in out, out[-2000:]
            assert p.returncode == 3, (r, p.returncode, out[-8000:])
            m = re.search(r"CHAOS_ERROR ([\d.]+) (.*)", out)
            assert m, out[-2000:]
            # The killed rank is named, by the detecting rank or in its abort.
            assert f"rank {victim}" in m.group(2), (r, victim, m.group(2))
            detect.append(elapsed)
        return victim, detect
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_killed_peer_fails_every_survivor_with_herring_error():
    rng = random.Random(1234)
    trials = 20 if LONG else 3
    all_detect = []
    for t in range(trials):
        victim, detect = _trial(rng)
        all_detect += detect
        print(f"trial {t}: killed rank {victim}, survivors exited after "
              f"{', '.join(f'{d:.1f}' for d in detect)} s")
    print(f"{trials} kills, {len(all_detect)} survivors failed with HerringError, "
          f"time to exit min/median/max {min(all_detect):.1f}/"
          f"{statistics.median(all_detect):.1f}/{max(all_detect):.1f} s, wrong results 0")
