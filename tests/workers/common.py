"""Shared helpers of the multi-process test workers: deterministic inputs, the
numpy reference of a hierarchical rank-order reduction, and result reporting.

A worker prints one line `HERRING_RESULT <json>` per case; the test driver
collects them from every rank (see tests/multiproc.py).
"""

from __future__ import annotations

import hashlib
import json
import sys

import ml_dtypes
import numpy as np

NP_DTYPES = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
}


_BASE_CACHE: dict[int, np.ndarray] = {}


def make_input(dtype: str, count: int, contributor: int, salt: int) -> np.ndarray:
    """Deterministic data that any rank can regenerate for any contributor.

    Floats are not small integers, so a sum taken in another order would give
    other bits: bitwise comparison against the rank-order reference is strict.
    One sine table per size is rotated and scaled per contributor, which keeps
    generating 64 MiB inputs cheap.
    """
    base = _BASE_CACHE.get(count)
    if base is None:
        _BASE_CACHE.clear()
        base = _BASE_CACHE[count] = np.sin(np.arange(count, dtype=np.float64) * 0.37)
    shift = (contributor * 7919 + salt * 104729) % max(count, 1)
    v = np.roll(base, shift)
    if dtype.startswith("int"):
        v = np.round(v * (1000 + contributor * 37 + salt))
        if dtype == "int64":
            v = v * 3_000_000_007  # beyond int32 range
        return v.astype(NP_DTYPES[dtype])
    return (v * (10.0 ** ((contributor + salt) % 4 - 1)) + contributor * 0.001).astype(
        NP_DTYPES[dtype])


def _acc_dtype(dtype: str) -> np.dtype:
    return np.dtype(np.float32) if dtype in ("bfloat16", "float16") else NP_DTYPES[dtype]


def reference(dtype: str, op: str, inputs: list[list[np.ndarray]]) -> np.ndarray:
    """inputs[process][device]: sum over local devices first, then processes in
    rank order, accumulating 16-bit types in float32 and rounding once per stage
    (the engine's documented order)."""
    acc_t = _acc_dtype(dtype)
    out_t = NP_DTYPES[dtype]
    locals_ = []
    for devs in inputs:
        acc = devs[0].astype(acc_t)
        for d in devs[1:]:
            acc = acc + d.astype(acc_t)
        locals_.append(acc.astype(out_t))
    with np.errstate(over="ignore"):
        acc = locals_[0].astype(acc_t)
        for x in locals_[1:]:
            acc = acc + x.astype(acc_t)
        if op == "mean":
            n = sum(len(devs) for devs in inputs)
            acc = acc / acc_t.type(n)
    return acc.astype(out_t)


def digest(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()[:16]


def bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def report(case: str, ok: bool, **fields) -> None:
    print("HERRING_RESULT " + json.dumps({"case": case, "ok": bool(ok), **fields}), flush=True)
    sys.stdout.flush()
