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


# Sizes that 2, 3 and 4 do not divide, a scalar. The core tier's layout (2
# processes) has the gathers' variants that change the program most
# (reshard_after_forward, prefetch 1 with small buckets, so that several are in
# flight), bfloat16 and an NNX model; the extended layouts the rest (a jitted
# init, every gather at once, the global-norm clip, a Linen model, 2 simulated
# hosts x 2 processes).
CASES = {
    2: "float32/adamw-masked/default+reshard+prefetch1,bfloat16/adam/default,model/nnx/adam",
    1: "float32/adam/default+reshard",
    3: "float32/nesterov/default+prefetch1,bfloat16/clip+adamw/default",
    4: "float32/adamw-masked/default+jit-init+all,bfloat16/schedule/default,"
       "float32/clip+adamw/default,model/linen/adam,model/nnx/adam",
}


@pytest.mark.parametrize("nproc,hosts", [(2, None), (1, None), (3, None), (4, 2)])
def test_the_parameters_match_the_unsharded_chain_on_every_process(nproc, hosts):
    # On 2 processes also: LAMB, adafactor and apply_if_finite refused at init,
    # as by sharded_optimizer.
    refused = ["--refused"] if nproc == 2 else []
    run = launch("fully_sharded_worker.py", ["--cases", CASES[nproc], *refused], nproc=nproc,
                 hosts=hosts, env=BITWISE, timeout=900)
    digests = assert_all_ok(run)
    # Every process ends with the same parameters.
    assert all(len(d) == 1 for d in digests.values()), digests
    # What each process holds between steps: 1/N of the parameters and of the
    # state, plus the chunks' padding (at most N-1 elements per leaf of the
    # parameters and of at most two moments) and the state's scalars.
    for case in _cases(run).values():
        if case["case"].startswith(("model/", "refused/")):
            continue
        padding = 3 * 5 * (nproc - 1) * 4 + 64
        assert case["held_bytes"] <= case["unsharded_bytes"] / nproc + padding, case


def test_a_codec_with_error_feedback_stays_close_to_the_exact_run():
    run = launch("fully_sharded_worker.py", ["--cases", "", "--codec", "bf16"], nproc=2,
                 timeout=600)
    assert_all_ok(run)
