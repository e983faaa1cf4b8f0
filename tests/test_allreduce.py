"""allreduce on real processes: every dtype, op and size, bitwise against the
numpy reference, for 2 processes with 2 devices and 4 processes with 1 and 2
devices. They share one host, so this is the host stage, both its direct path
(small buffers) and its two steps (tests/test_host_stage.py covers the
transport-only path and simulated hosts)."""

import os

import pytest

from multiproc import assert_all_ok, launch

DTYPES = ["float32", "float64", "bfloat16", "float16", "int32", "int64"]
COUNTS = "0,1,7,4097"
# Short mode under .ci/sanitizers.sh (HERRING_SANITIZER set): the
# instrumented engine is several times slower, so 1 MiB is the largest size.
MIB = "1" if os.environ.get("HERRING_SANITIZER") else "1,16"
# 64 MiB (16 chunks per part) once, on the largest layout, for float32 and
# bfloat16 (its float32 accumulation): chunking does not depend on the
# dtype, and the numpy reference of 64 MiB costs seconds per case.
BIG = [] if os.environ.get("HERRING_SANITIZER") else ["--big-mib", "64", "--big-dtypes",
                                                      "float32,bfloat16"]


def _expected_cases(num_sizes: int) -> int:
    combos = sum(1 if d.startswith("int") else 2 for d in DTYPES)  # no int mean
    return combos * num_sizes


@pytest.mark.parametrize("nproc,devices", [(2, 2), (4, 1), (4, 2)])
def test_every_dtype_op_and_size(nproc, devices):
    big = BIG if (nproc, devices) == (4, 1) else []
    run = launch("reduce_worker.py",
                 ["--devices", str(devices), "--counts", COUNTS, "--mib", MIB, "--stats", *big],
                 nproc=nproc, devices=devices)
    digests = assert_all_ok(
        run, expected_cases=_expected_cases(len(COUNTS.split(",")) + len(MIB.split(",")))
        + (4 if big else 0) + 1)
    # Bitwise the same on every rank (rank 0 checked its bits against numpy).
    differing = {case: d for case, d in digests.items() if len(d) != 1}
    assert not differing, differing
    # Every reduction took the host stage (not assumed: counted by the engine).
    for rank, results in run.results.items():
        [stats] = [r["stats"] for r in results if r["case"] == "stats"]
        assert stats["host_stage_calls"] == stats["reductions"] > 0, (rank, stats)
        # Both of its paths: the direct one (the small counts, within the
        # default HERRING_HOST_DIRECT_BYTES of 32 KiB) and the two steps (the
        # MiB sizes).
        assert 0 < stats["host_direct_calls"] < stats["host_stage_calls"], (rank, stats)


def test_fifty_reductions_in_one_jit():
    run = launch("many_worker.py", [], nproc=2)
    digests = assert_all_ok(run, expected_cases=100)
    assert all(len(d) == 1 for d in digests.values())


@pytest.mark.parametrize("provider,force_mr", [
    ("tcp;ofi_rxm", False),
    ("shm", False),
    ("udp;ofi_rxd", False),
    ("tcp;ofi_rxm", True),
])
def test_provider_matrix(provider, force_mr):
    env = {"HERRING_FI_PROVIDER": provider, "HERRING_FI_FORCE_MR": "1" if force_mr else "0",
           # 256 KiB chunks: the 4 MiB case sends several chunks per part.
           "HERRING_CHUNK_BYTES": str(256 * 1024),
           # The data itself must cross the provider, not the host stage.
           "HERRING_HOST_STAGE": "0"}
    run = launch("reduce_worker.py",
                 ["--dtypes", "float32,bfloat16,int64", "--ops", "sum", "--counts", "1,4097",
                  "--mib", "4", "--describe"],
                 nproc=2, env=env)
    assert_all_ok(run, expected_cases=3 * 3 + 1)
    described = [r["describe"] for rs in run.results.values() for r in rs if "describe" in r]
    assert len(described) == 2, run.explain()
    for text in described:
        assert text.split(" over ")[1].startswith(provider.split(";")[0]), text
        assert ("registered buffers" in text) == force_mr, text
        # Heartbeats are on by default, except over shm (see HERRING_HEARTBEAT_S).
        transport = text.split("; host ")[0]
        assert (", no heartbeats," if provider == "shm"
                else ", heartbeats every 1 s,") in transport, text
        # HERRING_CHUNK_BYTES above, and the smallest chunk's default.
        assert transport.endswith("parts in chunks of 256 KiB, across hosts of 1/4 of the "
                                  "part down to 16 KiB"), text
        assert text.endswith("host stage off: HERRING_HOST_STAGE=0"), text
