"""fully_sharded (ZeRO-3): the same parameters as optax.chain(
allreduce_gradients(), inner) on every process (bitwise for element-wise
inner transformations; test_sharded.py says why with
--xla_backend_optimization_level=0), whatever the prefetch depth, bucket
sizes and reshard_after_forward, and each process holding about 1/N of the
parameters and the optimizer state between steps."""

import pytest

from multiproc import assert_all_ok, launch

BITWISE = {"XLA_FLAGS": "--xla_backend_optimization_level=0"}


def _cases(run):
    return {r["case"]: r for r in run.results[0]}


@pytest.mark.parametrize("nproc,hosts", [(2, None), (4, 2)])
def test_the_parameters_match_the_unsharded_chain_on_every_process(nproc, hosts):
    args = (["--dtypes", "float32,bfloat16"] if nproc == 2
            else ["--dtypes", "float32", "--inners", "adamw-masked,clip+adamw"])
    run = launch("fully_sharded_worker.py", args, nproc=nproc, hosts=hosts, env=BITWISE,
                 timeout=900)
    digests = assert_all_ok(run)
    assert all(len(d) == 1 for d in digests.values()), digests
    cases = _cases(run)
    adamw = cases["float32/adamw-masked/default"]
    # Parameters + adamw's two moments, 1/N each, plus the chunks' padding
    # and the step count.
    assert adamw["held_bytes"] <= (1.02 / nproc) * adamw["unsharded_bytes"] + 64, adamw


def test_a_codec_with_error_feedback_stays_close_to_the_exact_run():
    run = launch("fully_sharded_worker.py", ["--inners", "sgd", "--dtypes", "float32",
                                              "--variants", "default", "--codec", "bf16"],
                 nproc=2, timeout=600)
    assert_all_ok(run)
