"""Shared helpers of the multi-process test workers: deterministic inputs, the
numpy reference of a hierarchical rank-order reduction, and result reporting.

A worker prints one line `HERRING_RESULT <json>` per case; the test driver
collects them from every rank (see tests/multiproc.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

from herring_jax._src.collectives import codecs

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


def make_tree(shapes: dict, contributor: int, step: int) -> dict:
    """float32 gradients of a worker at a step: one make_input leaf per name
    of `shapes`, each with its own salt (names in sorted order)."""
    return {k: make_input("float32", int(np.prod(s)), contributor, step * 3 + i).reshape(s)
            for i, (k, s) in enumerate(sorted(shapes.items()))}


def _acc_dtype(dtype: str) -> np.dtype:
    return np.dtype(np.float32) if dtype in ("bfloat16", "float16") else NP_DTYPES[dtype]


def _sum_in_order(parts: list[np.ndarray], acc_t: np.dtype) -> np.ndarray:
    acc = parts[0].astype(acc_t)
    for x in parts[1:]:
        acc = acc + x.astype(acc_t)
    return acc


def hosts_from_env(nproc: int) -> list[list[int]]:
    """The ranks of each host under `herring-jax launch`: HERRING_TEST_HOSTS
    ("2x2": 2 hosts of 2 processes, consecutive ranks) if the test set it, else
    one host holding every process."""
    text = os.environ.get("HERRING_TEST_HOSTS")
    if not text:
        return [list(range(nproc))]
    hosts, per_host = (int(v) for v in text.split("x"))
    assert hosts * per_host == nproc, (text, nproc)
    return [list(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)]


def host_stage_on() -> bool:
    return os.environ.get("HERRING_HOST_STAGE", "1") not in ("0", "false", "no", "off")


def reference(dtype: str, op: str, inputs: list[list[np.ndarray]],
              hosts: list[list[int]] | None = None, codec: str = "none") -> np.ndarray:
    """inputs[process][device], hosts[h] = the ranks of host h. The engine's
    documented order: the local devices of each process; then, where a host
    holds several processes (and every host the same number), the processes of
    each host in rank order and then the hosts in order; otherwise the processes
    in rank order. 16-bit types accumulate in float32 and round once per stage;
    a mean divides once, by the number of devices, at the last stage.

    A codec (float32 only) applies where data crosses over the transport: to
    the last stage, unless that is one host's processes reducing through the
    host stage (herring_jax/_src/collectives/codecs.py's reduce_np is its model)."""
    acc_t = _acc_dtype(dtype)
    out_t = NP_DTYPES[dtype]
    procs = [_sum_in_order(devs, acc_t).astype(out_t) for devs in inputs]
    hosts = hosts or [list(range(len(inputs)))]
    sizes = {len(h) for h in hosts}
    if len(hosts) > 1 and sizes != {1} and len(sizes) == 1:
        with np.errstate(over="ignore"):
            stage = [_sum_in_order([procs[r] for r in h], acc_t).astype(out_t) for h in hosts]
    else:
        stage = procs
    one_host_in_memory = len(hosts) == 1 and len(hosts[0]) > 1 and host_stage_on()
    if codec != "none" and len(stage) > 1 and not one_host_in_memory:
        assert dtype == "float32", dtype
        devices = sum(len(devs) for devs in inputs)
        return codecs.reduce_np(codec, op, stage, devices)
    with np.errstate(over="ignore"):
        acc = _sum_in_order(stage, acc_t)
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


def weighted_reference(dtype: str, inputs: list[list[np.ndarray]], weights: list[list[float]],
                       hosts: list[list[int]] | None = None, codec: str = "none") -> np.ndarray:
    """The weighted mean sum(w x) / sum(w) as herring_jax/_src/collectives/weighted.py
    defines it, inputs[process][device] and weights[process][device]: each
    product rounded once to the dtype (in float64 for float64 / complex128,
    else float32; exact zeros where w is 0), summed as `reference` sums
    (the weights in float32, exactly: no codec), times 1 / W; zeros for a
    total weight of 0, NaN everywhere if a weight is negative or not finite."""
    out_t = NP_DTYPES.get(dtype, np.dtype(dtype))
    c = np.float64 if out_t in (np.float64, np.complex128) else np.float32
    real = np.dtype(c)
    products, ws = [], []
    for xs, wl in zip(inputs, weights):
        ps = []
        for x, w in zip(xs, wl):
            w32 = np.float32(w)
            with np.errstate(invalid="ignore", over="ignore"):
                if out_t.kind == "c":
                    p = (x.real.astype(real) * real.type(w32)
                         + 1j * (x.imag.astype(real) * real.type(w32))).astype(out_t)
                else:
                    p = (x.astype(c) * c(w32)).astype(out_t)
            ps.append(np.zeros_like(p) if w32 == 0 else p)
        products.append(ps)
        ws.append([np.array([w], np.float32) for w in wl])
    s = reference(dtype, "sum", products, hosts, codec=codec) if out_t.kind != "c" else \
        _complex_sum(products, hosts)
    total = reference("float32", "sum", ws, hosts)[0]
    flat = [np.float32(w) for wl in weights for w in wl]
    if any(w < 0 or not np.isfinite(w) for w in flat):
        return np.full(s.shape, np.nan, out_t)
    if total == 0:
        return np.zeros(s.shape, out_t)
    with np.errstate(over="ignore", invalid="ignore"):
        r = c(1) / c(total)  # one scalar division; the data times its result
        if out_t.kind == "c":
            return (s.real.astype(real) * r + 1j * (s.imag.astype(real) * r)).astype(out_t)
        return (s.astype(c) * r).astype(out_t)


def _complex_sum(inputs, hosts):
    """`reference`'s sum of complex values: the real and imaginary parts each."""
    real = {np.dtype(np.complex64): "float32", np.dtype(np.complex128): "float64"}[
        inputs[0][0].dtype]
    re = reference(real, "sum", [[x.real.copy() for x in xs] for xs in inputs], hosts)
    im = reference(real, "sum", [[x.imag.copy() for x in xs] for xs in inputs], hosts)
    return (re + 1j * im).astype(inputs[0][0].dtype)


def exit_together(tag: str, ranks: list[int], timeout: float = 60.0) -> None:
    """Waits (at most `timeout` s) until every rank in `ranks` has called this
    with the same tag, then returns. For survivors of a failure that report
    and exit: the first to exit would end the job's jax coordination service
    (hosted by rank 0), whose clients then terminate the others' processes,
    perhaps before they have reported. Marker files in a folder of this job
    (named by its coordinator's address); the last rank to see them all
    removes it."""
    address = os.environ.get("HERRING_COORDINATOR_ADDRESS", "job").replace(":", "-")
    folder = os.path.join(tempfile.gettempdir(), f"herring-test-{tag}-{address}")
    os.makedirs(folder, exist_ok=True)
    me = int(os.environ["HERRING_PROCESS_ID"])
    open(os.path.join(folder, f"here.{me}"), "w").close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(folder, f"here.{r}")) for r in ranks):
            break
        time.sleep(0.05)
    open(os.path.join(folder, f"seen.{me}"), "w").close()
    if all(os.path.exists(os.path.join(folder, f"seen.{r}")) for r in ranks):
        shutil.rmtree(folder, ignore_errors=True)

