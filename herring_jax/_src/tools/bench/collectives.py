"""The collectives `herring-jax bench --collective` times: what each process
gives and gets for a buffer of S MiB, the result it must hold, and the least
time the collective needs (its bound).

S is the buffer every collective is about, so that rates compare across them:
- allreduce: each process gives S and gets the S-sum;
- reduce_scatter: each process gives S and gets its 1/n of the sum
  (part r = elements [r*B, (r+1)*B) of the sum, B = S/n);
- all_gather: each process gives S/n (part r of the buffer) and gets all S.
The element count of a reduce-scatter or all-gather is rounded up to a
multiple of n, so that every peer (Open MPI's Reduce_scatter_block and
torch's reduce_scatter want equal parts) moves the same bytes.
"""

from __future__ import annotations

import numpy as np

COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather")

# The least time each collective needs. Over a link (the shaped network, or
# --link-gbps), h hosts: an all-reduce's host sends (h-1)/h of its share to
# the other hosts' servers and gets as much back, so each direction of its
# link carries 2(h-1)/h * bytes. Either half carries half of that: a
# reduce-scatter's host must send the (h-1)/h of its buffer that the other
# hosts own, an all-gather's host must receive the (h-1)/h it does not hold
# (its own processes give the other 1/h), each in one direction.
LINK_FORMULAS = {
    "allreduce": "bound = 2(h-1)/h * bytes / link",
    "reduce_scatter": "bound = (h-1)/h * bytes / link",
    "all_gather": "bound = (h-1)/h * bytes / link",
}
# On one host, through memory: every input byte must be read once and every
# output byte written once, and the measured copy rate counts a byte read
# and written. An all-reduce reads n*bytes and writes n*bytes: n*bytes
# copied. A reduce-scatter reads n*bytes and writes n parts of bytes/n; an
# all-gather reads n parts of bytes/n and writes n*bytes: (n+1)*bytes of
# traffic either way, (n+1)/2 * bytes copied.
MEMORY_FORMULAS = {
    "allreduce": "bound = n * bytes / memory (the rate all cores copy at together)",
    "reduce_scatter": "bound = (n+1)/2 * bytes / memory (n inputs read, one buffer written)",
    "all_gather": "bound = (n+1)/2 * bytes / memory (one buffer read, n outputs written)",
}
# nccl-tests' bus bandwidth: algbw times the share of the bytes that a ring
# moves per process, comparable across process counts.
BUS_FACTORS = {"allreduce": lambda n: 2 * (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n}
SEMANTICS = {
    "allreduce": "each process gives the buffer and gets the sum",
    "reduce_scatter": "each process gives the buffer and gets its 1/n part of the sum",
    "all_gather": "each process gives 1/n of the buffer and gets all of it",
}


def parse(text: str) -> list[str]:
    """The collectives of a comma list, checked; raises ValueError."""
    names = [c for c in text.split(",") if c]
    unknown = [c for c in names if c not in COLLECTIVES]
    if unknown or not names:
        raise ValueError(f"unknown collectives {unknown or [text]}; known: "
                         f"{', '.join(COLLECTIVES)}")
    return list(dict.fromkeys(names))


def elements(mib: float, collective: str, n: int) -> int:
    """The float32 elements of the S-MiB buffer of `collective` on n processes."""
    count = int(mib * 2**20) // 4
    return count if collective == "allreduce" else -(-count // n) * n


def pattern(count: int, rank: int) -> np.ndarray:
    """Process `rank`'s buffer of `count` float32 values."""
    # Small integers: every partial sum is exact in float32 whatever the
    # summation order, so the check can demand equality; the ramp catches
    # parts written to the wrong place, which a constant fill would not.
    return ((np.arange(count, dtype=np.int64) % 251 + 1) * (rank + 1)).astype(np.float32)


def local_input(collective: str, count: int, rank: int, n: int) -> np.ndarray:
    """What process `rank` gives to `collective` on a buffer of `count` elements."""
    if collective == "all_gather":
        part = count // n
        return pattern(count, rank)[rank * part:(rank + 1) * part].copy()
    return pattern(count, rank)


def part_of(collective: str, full: np.ndarray, rank: int, n: int) -> np.ndarray:
    """Process `rank`'s share of `full`, the buffer every process would hold
    after an all-reduce (the sum) or an all-gather (the parts side by side)."""
    if collective != "reduce_scatter":
        return full
    part = full.size // n
    return full[rank * part:(rank + 1) * part].copy()


def expected(collective: str, count: int, rank: int, n: int) -> np.ndarray:
    """The exact result process `rank` must hold."""
    if collective == "all_gather":
        return np.concatenate([local_input(collective, count, r, n) for r in range(n)])
    return part_of(collective, pattern(count, 0) * np.float32(n * (n + 1) // 2), rank, n)


def bound_s(collective: str, nbytes: float, n: int, rate_gbps: float | None,
            kind: str = "link", hosts: int | None = None) -> float | None:
    """The least time `collective` on a buffer of `nbytes` needs (LINK_FORMULAS
    or MEMORY_FORMULAS), or None without a rate or with nothing to move."""
    if not rate_gbps or n < 2:
        return None
    rate = rate_gbps * 1e9
    if kind == "memory":
        return (n if collective == "allreduce" else (n + 1) / 2) * nbytes / rate
    h = hosts or n
    if h < 2:
        return None
    crossing = (h - 1) / h * nbytes
    return (2 if collective == "allreduce" else 1) * crossing / rate
