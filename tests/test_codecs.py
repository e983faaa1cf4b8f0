"""Compressed reductions (codec= of allreduce / psum / allreduce_gradients):
every codec on several processes, bitwise against the numpy model of the
engine's codecs (herring_jax/_src/collectives/codecs.py: contributions encoded, decoded
and summed in float32 in rank order, the result encoded once more), over the
transport and through the host stage, where only the hosts' shares are
encoded. Non-float32 leaves of a compressed reduction stay exact. Error
feedback keeps exactly what the engine's encoding lost, where it encoded:
nothing on one host, each host's sum across hosts. Each
codec's own round trip and bounds are tests/cpp/codec_wire_test.cc; a codec
mismatch between processes is tests/test_failures.py."""

import numpy as np
import pytest

from herring_jax._src.collectives import codecs
from multiproc import assert_all_ok, launch

COUNTS = "1,7,300,4097,100003"


def _run(codecs, nproc=4, hosts=None, env=None):
    run = launch("reduce_worker.py",
                 ["--dtypes", "float32,int32", "--ops", "sum,mean", "--counts", COUNTS,
                  "--mib", "1", "--codec", ",".join(codecs), "--stats"],
                 nproc=nproc, hosts=hosts, env=env)
    # Per codec, float32: 2 ops x 6 sizes, int32: 6 sizes; and the stats.
    assert_all_ok(run, expected_cases=len(codecs) * (12 + 6) + 1)
    lossy = [r for r in run.results[0] if "float32/" in r["case"]
             and int(r["case"].split("/")[2]) >= 300]
    assert len(lossy) == 8 * len(codecs), run.results[0]
    # The codec really compressed: no float32 result of 300 elements or more
    # has the exact reduction's bits (the inputs use all 24 mantissa bits).
    assert all(r["exact"] is False for r in lossy), lossy
    return run


def test_every_codec_over_the_transport_matches_the_numpy_model():
    run = _run(["bf16", "fp16", "int8"], env={"HERRING_HOST_STAGE": "0"})
    stats = [r for r in run.results[0] if r["case"] == "stats"][0]["stats"]
    assert stats["host_stage_calls"] == 0, stats


def test_codec_through_the_host_stage_encodes_the_hosts_shares():
    # 2 hosts x 2 processes: each host sums in float32 through memory, and
    # only the hosts' sums travel as int8.
    run = _run(["int8"], hosts=2)
    for rs in run.results.values():
        stats = [r for r in rs if r["case"] == "stats"][0]["stats"]
        assert stats["host_stage_calls"] == stats["reductions"] > 0, stats


def test_error_feedback_residual_is_what_the_contribution_lost():
    # allreduce_gradients(compression="int8"): every step's update and
    # residual against the numpy model, on 2 processes
    # (tests/workers/ef_worker.py); int8 has the blocks and scales.
    run = launch("ef_worker.py", ["--codec", "int8"], nproc=2,
                 env={"HERRING_HOST_STAGE": "0"})
    assert_all_ok(run, expected_cases=4)


@pytest.mark.parametrize("transform", ["allreduce", "sharded"])
@pytest.mark.parametrize("hosts,nproc", [(None, 2), (2, 4), (2, 2)],
                         ids=["1x2", "2x2", "2x1"])
def test_error_feedback_keeps_what_the_engine_encoding_lost(transform, hosts, nproc):
    # allreduce_gradients / sharded_optimizer(compression="int8") through the
    # host stage: on one host nothing is encoded, so the residual stays zero
    # and every step is the exact mean; across hosts each process keeps what
    # its slice of its host's sum lost (2x2), or its own contribution (2x1).
    # Every step's result and residual against the numpy model of what was
    # encoded where (tests/workers/ef_host_worker.py).
    run = launch("ef_host_worker.py", ["--codec", "int8", "--transform", transform],
                 nproc=nproc, hosts=hosts)
    assert_all_ok(run, expected_cases=4)


def test_fully_sharded_error_feedback_keeps_what_the_engine_encoding_lost():
    # fully_sharded(compression="int8") on 2 hosts x 2 processes: each
    # process keeps exactly what its parts of its host's float32 sum lost
    # (zeros elsewhere), not what its own contribution would have lost.
    # Every step's gradient chunk and residual against the numpy model.
    run = launch("ef_host_worker.py", ["--codec", "int8", "--transform", "fully"],
                 nproc=4, hosts=2)
    assert_all_ok(run, expected_cases=4)


@pytest.mark.parametrize("hosts,nproc", [(None, 2), (2, 4)], ids=["1x2", "2x2"])
def test_error_feedback_of_processes_with_two_devices(hosts, nproc):
    # allreduce_gradients('d') inside shard_map, 2 devices per process: a
    # process encodes its devices' sum (or its slice of its host's sum), and
    # its first device keeps the loss, the other zeros.
    run = launch("ef_host_worker.py", ["--codec", "int8", "--devices", "2"],
                 nproc=nproc, devices=2, hosts=hosts)
    assert_all_ok(run, expected_cases=4)


def test_numpy_model_bounds():
    # The model itself: each codec's error stays within its bound of the
    # block's largest magnitude, and the sizes on the wire are as documented.
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(10_000) * np.exp(rng.uniform(-8, 8, 10_000))).astype(np.float32)
    blocks = np.pad(np.abs(x), (0, -x.size % 256)).reshape(-1, 256).max(axis=1)
    m = np.repeat(blocks, 256)[:x.size]
    for codec, bound in (("bf16", None), ("fp16", 2.0**-10), ("int8", 1 / 254 + 2.0**-16)):
        err = np.abs(codecs.roundtrip_np(codec, x) - x)
        limit = np.abs(x) * 2.0**-8 if bound is None else m * bound
        assert np.all(err <= limit), codec
        assert np.any(err > 0), codec
    # jax's model (error feedback) gives numpy's bits, inside jit too.
    import jax
    for codec in ("bf16", "fp16", "int8"):
        got = np.asarray(jax.jit(lambda v: v - codecs.roundtrip(codec, v))(x))
        assert got.tobytes() == (x - codecs.roundtrip_np(codec, x)).tobytes(), codec
    # Blocks of tiny values (largest magnitude below 2^-100, subnormals
    # included): int8 decodes them to zeros, nothing becomes inf or NaN.
    tiny = np.full(512, 1e-39, np.float32)
    tiny[256:] = 3e-31
    for codec in ("bf16", "fp16", "int8"):
        out = codecs.roundtrip_np(codec, tiny)
        assert np.all(np.isfinite(out)), codec
        assert np.all(np.isfinite(np.asarray(jax.jit(lambda v: codecs.roundtrip(codec, v))(tiny))))
    assert np.all(codecs.roundtrip_np("int8", tiny) == 0)
    assert codecs.wire_bytes("bf16", 1000) == 2000
    assert codecs.wire_bytes("int8", 1000) == 1000 + 4 * 4
    with pytest.raises(ValueError, match="unknown codec 'int4'"):
        codecs.check_codec("int4")
