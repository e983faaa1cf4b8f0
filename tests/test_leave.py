"""A clean exit never fails a peer's reduction (docs/guides/failures.md, "Exiting").

A rank leaves as soon as its own last reduction returns, while its peers may
still be taking in its last result chunks; the leave protocol
(xla_ffi/engine/leave_ledger.h, departures.cc) keeps its endpoint open until
each peer has confirmed them all. Without it, under load, a peer's last
all-reduce failed with "receive from rank R failed ... Connection reset by
peer" (issue 37): a send completes once the bytes are in the socket buffer,
and the leaver's close reset the connection.
"""

from __future__ import annotations

import re
import time

import pytest

import exit_soak
from multiproc import launch

NPROC = 4
# Result chunks of 128 KiB, 4 per part: several are still on their way when
# the fastest rank's last call returns. Heartbeats every 10 ms: a close then
# usually finds one unread, and a close with unread data resets the
# connection. The old exit failed 3 of 20 launches so (and 2 of 15 with
# 8M elements in 1 MiB chunks), with "Connection reset by peer" or a peer
# waiting for data that never came; with 1 s heartbeats the loss is rarer,
# not gone.
WORKER_ARGS = ["--steps", "3", "--count", "2000000"]
ENV = {"HERRING_HEARTBEAT_S": "0.01", "HERRING_CHUNK_BYTES": "131072",
       "HERRING_PEER_TIMEOUT_S": "10", "HERRING_TIMEOUT_S": "60"}


@pytest.fixture
def cpu_hog():
    """Busy loops on both cores beside the job: the ranks lag each other."""
    hogs = exit_soak.start_hogs(2)
    yield
    exit_soak.stop_hogs(hogs)


def _launches(n: int, stage: str, extra: list[str] = (), env: dict | None = None):
    failures = []
    for i in range(n):
        run = launch("leave_worker.py", [*WORKER_ARGS, "--seed", str(i), *extra], nproc=NPROC,
                     env={**ENV, "HERRING_HOST_STAGE": stage, **(env or {})}, timeout=120)
        why = exit_soak.failure(run, NPROC)
        if why:
            failures.append(f"launch {i}: {why}\n{run.explain()}")
    return failures


@pytest.mark.parametrize("stage,launches", [("0", 3), ("1", 2)],
                         ids=["transport", "host-stage"])
def test_ranks_that_exit_right_after_their_last_reduction_fail_no_peer(cpu_hog, stage,
                                                                       launches):
    # The old exit failed about one launch in 7 (transport) this way: the
    # extended part's 20 launches a path catch it.
    failures = _launches(launches, stage)
    assert not failures, failures[0]


@pytest.mark.extended
@pytest.mark.parametrize("stage", ["0", "1"], ids=["transport", "host-stage"])
def test_many_exits_under_load_fail_no_peer(cpu_hog, stage):
    # 20 launches over the transport: the old exit failed one in 7 here
    # (found by 20 with 95% odds); 12 through the host stage (84% at that
    # rate), for the extended part's time (each variant took 100 s on a
    # loaded machine). (Not with ranks that wait a
    # random moment before they exit: their peers have taken in everything by
    # then, and 20 such launches of the old exit passed.)
    launches = 20 if stage == "0" else 12
    failures = _launches(launches, stage)
    assert not failures, f"{len(failures)} of {launches} failed\n{failures[0]}"


def test_a_peer_stopped_in_its_last_reduction_still_gets_every_message(cpu_hog):
    # Rank 3 is stopped (every thread) for 4 s at a random moment of its last
    # all-reduce: the others may finish and leave meanwhile, and must keep
    # their endpoints until it has taken in their last chunks: no "has shut
    # down" (it does run that reduction) and no reset connection.
    failures = _launches(1, "0", ["--stop-rank", "3", "--stop-s", "4", "--stop-at", "during"])
    assert not failures, failures[0]


@pytest.mark.extended
@pytest.mark.parametrize("stage", ["0", "1"], ids=["transport", "host-stage"])
def test_lagging_peers_get_every_message(cpu_hog, stage):
    failures = _launches(3, stage, ["--stop-rank", "3", "--stop-s", "4", "--stop-at", "during"])
    failures += _launches(2, stage, ["--lag-rank", "1", "--lag-s", "3"])
    assert not failures, failures[0]


def test_an_exiting_rank_waits_for_a_stopped_peer_and_names_it():
    # Rank 1 is stopped for 8 s right after its last reduction, before rank
    # 0's kLeave reaches it: rank 0 must wait for its receipt (saying so after
    # 5 s) rather than close, and both end cleanly.
    start = time.monotonic()
    run = launch("leave_worker.py",
                 ["--steps", "2", "--count", "1000", "--stop-rank", "1", "--stop-s", "8",
                  "--stop-at", "after", "--exit-delay-s", "1"],
                 nproc=2, env={"HERRING_HOST_STAGE": "0", "HERRING_TIMEOUT_S": "60"},
                 timeout=120)
    assert not exit_soak.failure(run, 2), run.explain()
    assert re.search(r"herring_jax rank 0: exiting; has waited \d+ s for rank\(s\) 1 "
                     r"\(still running\) to receive its last messages", run.stderr), run.explain()
    assert time.monotonic() - start < 50, run.explain()


@pytest.mark.parametrize("stage", ["0", pytest.param("1", marks=pytest.mark.extended)],
                         ids=["transport", "host-stage"])
def test_a_rank_that_runs_one_reduction_fewer_fails_the_others_fast(stage):
    # HERRING_TIMEOUT_S is 60: the others must fail long before it, naming
    # rank 2 as shut down (the counts say that it never sent the data).
    run = launch("leave_worker.py", [*WORKER_ARGS, "--fewer-rank", "2"], nproc=NPROC,
                 env={**ENV, "HERRING_HOST_STAGE": stage}, timeout=120)
    assert sorted(run.results) == list(range(NPROC)), run.explain()
    assert run.results[2][0]["ok"], run.explain()
    last = int(WORKER_ARGS[1]) - 1
    for rank in (0, 1, 3):
        res = run.results[rank][0]
        assert not res["ok"], run.explain()
        # The first rank to find rank 2 gone fails the job: a rank still one
        # step behind (a loaded machine: seen in CI) then fails in that step,
        # with the first rank's error relayed, never earlier.
        relayed = re.search(r"rank \d+ failed: rank 2 has shut down", res["message"])
        assert res["step"] == last or (res["step"] == last - 1 and relayed), run.explain()
        assert "rank 2 has shut down herring_jax" in res["message"], run.explain()
        assert res["seconds"] < 15, run.explain()


@pytest.mark.parametrize("provider", ["shm", "udp;ofi_rxd"])
def test_exits_over_providers_that_do_not_order_messages_wait_for_nobody(provider):
    # Over shm and udp;ofi_rxd a kLeave may overtake the data sent before it:
    # the counts keep the peers waiting for that data, and each peer's receipt
    # comes at once. Over udp;ofi_rxd every notice was dropped (its sources
    # named rank 0 for every sender) and each exit waited for the peers to
    # fall silent.
    run = launch("leave_worker.py", ["--steps", "3", "--count", "200000"], nproc=NPROC,
                 env={"HERRING_HOST_STAGE": "0", "HERRING_FI_PROVIDER": provider,
                      "HERRING_CHUNK_BYTES": "131072", "HERRING_TIMEOUT_S": "60"},
                 timeout=120)
    assert not exit_soak.failure(run, NPROC), run.explain()
    assert "dropped a message" not in run.stderr, run.explain()
    assert "exiting; has waited" not in run.stderr, run.explain()
