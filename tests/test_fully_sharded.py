"""fully_sharded (ZeRO-3): the same parameters as optax.chain(
allreduce_gradients(), inner) on every process (bitwise for element-wise
inner transformations; test_sharded.py says why with
--xla_backend_optimization_level=0), whatever the prefetch depth, bucket
sizes and reshard_after_forward, and each process holding about 1/N of the
parameters and the optimizer state between steps."""

import pytest

from multiproc import BITWISE_COMPILE, assert_all_ok, launch

BITWISE = {"XLA_FLAGS": BITWISE_COMPILE}


def _cases(run):
    return {r["case"]: r for r in run.results[0]}


# Sizes that 2, 3 and 4 do not divide, a scalar. The core tier's layout (2
# processes) has the gathers' variants that change the program most
# (reshard_after_forward, prefetch 1 with small buckets, so that several are in
# flight), bfloat16 and an NNX model; the extended layouts the rest (a jitted
# init, every gather at once, the global-norm clip, a Linen model, 2 simulated
# hosts x 2 processes, an attention block as examples/train_lm.py's).
CASES = {
    2: "float32/adamw-masked/default+reshard+prefetch1,bfloat16/adam/default,model/nnx/adam",
    1: "float32/adam/default+reshard",
    3: "float32/nesterov/default+prefetch1,bfloat16/clip+adamw/default,model/attention/adam",
    4: "float32/adamw-masked/default+jit-init+all,bfloat16/schedule/default,"
       "float32/clip+adamw/default,model/linen/adam,model/nnx/adam",
}


@pytest.mark.parametrize("nproc,hosts", [(2, None), (1, None), (3, None), (4, 2)])
def test_the_parameters_match_the_unsharded_chain_on_every_process(nproc, hosts):
    # On 2 processes also: LAMB, adafactor and apply_if_finite refused at init,
    # as by sharded_optimizer, and integer and bool leaves (TypeError naming them);
    # and reshard_after_forward saves nothing of a whole parameter's size for the
    # backward pass (casts, transposes, a sine and its cosine recomputed there);
    # and prefetch=p lets p gathers run ahead of the awaited one while no
    # reduce-scatter waits for another (the step's traced program).
    refused = ["--refused", "--saved-residuals", "--prefetch-structure"] if nproc == 2 else []
    run = launch("fully_sharded_worker.py", ["--cases", CASES[nproc], *refused], nproc=nproc,
                 hosts=hosts, env=BITWISE, timeout=900)
    digests = assert_all_ok(run)
    # Every process ends with the same parameters.
    assert all(len(d) == 1 for d in digests.values()), digests
    # What each process holds between steps: 1/N of the parameters and of the
    # state, plus the chunks' padding (at most N-1 elements per leaf of the
    # parameters and of at most two moments) and the state's scalars.
    for case in _cases(run).values():
        if case["case"].startswith(("model/", "refused/", "reshard/", "prefetch/")):
            continue
        padding = 3 * 5 * (nproc - 1) * 4 + 64
        assert case["held_bytes"] <= case["unsharded_bytes"] / nproc + padding, case


# Error feedback (tests/workers/fully_sharded_ef_worker.py). With the host
# stage off, each process's gradients cross the wire encoded even on one host.
WIRE = {"HERRING_HOST_STAGE": "0"}


def test_error_feedback_brings_every_codec_nearer_the_exact_run():
    # A tanh model, sgd(0.5), 20 steps: with each codec, error feedback on
    # changes the parameters and ends nearer the uncompressed run than off.
    run = launch("fully_sharded_ef_worker.py", ["--case", "codecs", "--steps", "20"], nproc=2,
                 env=WIRE)
    digests = assert_all_ok(run, expected_cases=3)
    assert sorted(digests) == ["codecs/bf16", "codecs/fp16", "codecs/int8"], digests
    for case in run.results[0]:
        assert case["residual_max"] > 0, case


def test_accumulated_microbatches_add_each_residual_once():
    # Three microbatches per step through value_and_grad(accumulate=), every
    # codec (int8 also with reshard_after_forward): each step's gradient
    # chunks and residual bitwise the numpy model in which every reduction
    # adds the residual the one before it left.
    run = launch("fully_sharded_ef_worker.py", ["--case", "model", "--steps", "3"], nproc=2,
                 env=WIRE)
    assert_all_ok(run, expected_cases=4 * 3)


def test_one_host_encodes_nothing_so_error_feedback_keeps_no_residual():
    # The host stage sums one host's processes in float32 through memory:
    # nothing is lost, so the compressed run with error feedback is bitwise
    # the exact one and its residual stays zeros.
    run = launch("fully_sharded_ef_worker.py", ["--case", "one-host", "--codecs", "int8",
                                                "--steps", "5"], nproc=2)
    assert_all_ok(run, expected_cases=1)
