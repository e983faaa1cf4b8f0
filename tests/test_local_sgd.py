"""local_sgd, slowmo and diloco (tests/workers/local_sgd_worker.py): with
every=1 and the plain outer sgd(1.0), bitwise allreduce_gradients' training;
each preset bitwise a numpy model of its algorithm at every step on 2 and 4
processes, herring reducing at the sync steps only; int8 with error
feedback bitwise the codec's model; streaming's fragments (F = 2 and 3)
each synced alone at its step of the period, and with a delay (1 and 2
steps) each reduced while the next steps run and applied once on arrival,
bitwise the numpy model; inside nnx.Optimizer and a Linen
TrainState bitwise the plain pytree; an NNX checkpoint saved mid-period
resuming bitwise; and inside shard_map over a mesh axis.

XLA_FLAGS=--xla_backend_optimization_level=0: with LLVM's optimizations
XLA:CPU contracts a multiply and an add of one fused loop into one fused
multiply-add, differently in the two programs compared (tests/test_sharded.py
says more). HERRING_HOST_STAGE=0: a codec applies where data crosses the
transport, which with the host stage on is nowhere between processes of one
host.
"""

import pytest

from multiproc import BITWISE_COMPILE, assert_all_ok, launch, train_bench_codecs

ENV = {"XLA_FLAGS": BITWISE_COMPILE, "HERRING_HOST_STAGE": "0"}
PRESETS = ["localsgd/model", "slowmo/model", "diloco/model"]
FLAX = ["nnx/vs-plain", "nnx/checkpoint", "linen/vs-plain"]
FRAGMENTED = [f"fragments/{p}" for p in PRESETS] + ["fragments/int8/model"]
DELAYED = [f"delay/{p}" for p in PRESETS] + ["delay/int8/model"]


def _check(run, cases):
    digests = assert_all_ok(run, expected_cases=len(cases))
    assert sorted(r["case"] for r in run.results[0]) == sorted(cases)
    return digests, {r["case"]: r for r in run.results[0]}


def test_every_step_is_allreduce_gradients_and_the_presets_match_their_model(tmp_path):
    run = launch("local_sgd_worker.py", ["--dir", str(tmp_path)], nproc=2, env=ENV)
    digests, cases = _check(run, ["h1/vs-allreduce", "donated", *PRESETS, "int8/model", *FLAX,
                                  *FRAGMENTED, *DELAYED])
    # H = 1 and every sync: the same parameters on every process.
    assert len(digests["h1/vs-allreduce"]) == 1, digests
    for name in PRESETS:
        # 7 steps with every=3: reductions at steps 3 and 6 only.
        assert cases[name]["reduced_at_syncs_only"] == [True] * 7, cases[name]
        assert cases[name]["synced"] == [None, None, 0, None, None, 0, None], cases[name]
    assert cases["int8/model"]["residual_max"] > 0, cases["int8/model"]
    # Streaming, every=4 and 2 fragments: fragment 1 at counts 2 and 6,
    # fragment 0 at 4 and 8, each reducing its own bytes and nothing else.
    for name in FRAGMENTED[:-1]:
        assert cases[name]["synced"] == [None, 1, None, 0, None, 1, None, 0, None], cases[name]
        assert cases[name]["reduced_at_syncs_only"] == [True] * 9, cases[name]
    # every=3 and 3 fragments: one fragment each step, in turn, int8 with error feedback.
    int8 = cases["fragments/int8/model"]
    assert int8["synced"] == [1, 2, 0, 1, 2, 0, 1] and int8["residual_max"] > 0, int8
    # Delay 1: each fragment sent at its sync step (s) and applied one step
    # later (a), while the next step computes; fragment 0's first arrival
    # (count 1) has nothing before it. Every start's bytes reduced once.
    for name in DELAYED[:-1]:
        assert cases[name]["synced"] == [None, "s1", "a1", "s0", "a0", "s1", "a1", "s0",
                                         "a0"], cases[name]
        assert cases[name]["bytes_ok"], cases[name]
    # Delay 2, every 6, fragments a | b c, int8 with error feedback.
    int8 = cases["delay/int8/model"]
    assert int8["synced"] == [None, None, "s1", None, "a1", "s0", None, "a0", "s1", None, "a1",
                              "s0", None, "a0"] and int8["residual_max"] > 0, int8


def test_the_presets_match_their_model_on_four_processes():
    run = launch("local_sgd_worker.py", ["--cases", "presets,int8"], nproc=4, env=ENV)
    _check(run, [*PRESETS, "int8/model"])


def test_inside_shard_map_every_device_is_a_worker():
    # 2 processes x 2 devices: the engine sums each process's devices first.
    run = launch("local_sgd_worker.py", ["--mesh"], nproc=2, devices=2, env=ENV)
    _check(run, [f"mesh/{p}" for p in PRESETS])


def test_bad_arguments_are_refused_with_the_fix():
    import jax.numpy as jnp
    import numpy as np
    import optax

    import herring_jax
    for every in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="every must be a positive int"):
            herring_jax.local_sgd(optax.sgd(0.1), every)
    assert isinstance(herring_jax.local_sgd(optax.sgd(0.1), np.int64(4)),
                      optax.GradientTransformation)
    with pytest.raises(ValueError, match="learning_rate is gamma"):
        herring_jax.slowmo(optax.sgd(0.1), 4, learning_rate=0.0)
    with pytest.raises(ValueError, match="unknown codec"):
        herring_jax.diloco(optax.adamw(1e-3), 4, compression="int4")
    tx = herring_jax.local_sgd(optax.sgd(0.1), 2)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    assert isinstance(state, herring_jax.LocalSGDState)
    with pytest.raises(ValueError, match=r"tx.update\(grads, state, params\)"):
        tx.update(params, state)
    with pytest.raises(TypeError, match="LocalSGDState"):
        tx.update(params, optax.EmptyState(), params)


def test_fragments_are_runs_of_leaves_of_about_equal_bytes():
    import jax.numpy as jnp
    import optax

    import herring_jax
    from herring_jax._src.transforms.streaming import fragment_leaves

    def tree(*sizes):
        return {f"l{i:02d}": jnp.zeros(n, jnp.float32) for i, n in enumerate(sizes)}

    # The tests' trees (tests/workers/local_sgd_worker.py): cut nearest the shares.
    assert fragment_leaves(tree(37, 35, 20, 12), 2) == [0, 1, 1, 1]
    assert fragment_leaves(tree(37, 35, 20, 12), 3) == [0, 1, 2, 2]
    assert fragment_leaves(tree(10, 10, 10, 10), 2) == [0, 0, 1, 1]
    assert fragment_leaves(tree(10, 10, 10, 10), 4) == [0, 1, 2, 3]
    assert fragment_leaves(tree(10, 10, 10, 10), 1) == [0, 0, 0, 0]
    # A leaf of most of the bytes first still leaves every fragment a leaf.
    assert fragment_leaves(tree(1000, 1, 1, 1), 3) == [0, 1, 2, 2]
    assert fragment_leaves(tree(1, 1, 1, 1000), 3) == [0, 0, 1, 2]
    with pytest.raises(ValueError, match="use at most 2 fragments"):
        fragment_leaves(tree(3, 4), 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="fragments must be an int of at least 1"):
            herring_jax.local_sgd(optax.sgd(0.1), 4, fragments=bad)
    with pytest.raises(ValueError, match="use at most 4 fragments"):
        herring_jax.diloco(optax.adamw(1e-3), 4, fragments=5)
    tx = herring_jax.local_sgd(optax.sgd(0.1, momentum=0.9), 4, optax.sgd(0.7, momentum=0.9),
                               fragments=2)
    state = tx.init(tree(37, 35, 20, 12))
    # One outer state per fragment, over that fragment's leaves only.
    assert len(state.outer) == 2
    assert [x.shape for x in jax_leaves(state.outer[0])] == [(37,)]
    assert [x.shape for x in jax_leaves(state.outer[1])] == [(35,), (20,), (12,)]
    with pytest.raises(ValueError, match="use at most 1 fragments"):
        herring_jax.local_sgd(optax.sgd(0.1), 4, fragments=2).init({"w": jnp.ones(3)})


def jax_leaves(tree):
    import jax
    return [x for x in jax.tree_util.tree_leaves(tree) if getattr(x, "ndim", 0) > 0]


def test_train_bench_names_the_local_runs():
    from herring_jax._src.tools.train_bench import _codec_args
    assert _codec_args("diloco16-int8") == (
        ["--local-steps", "16", "--outer", "diloco", "--compression", "int8"], "diloco16-int8")
    assert _codec_args("localsgd4") == (
        ["--local-steps", "4", "--outer", "sgd", "--compression", "none"], "localsgd4")
    assert _codec_args("slowmo8-bf16")[0][3] == "slowmo"
    assert _codec_args("compute") == (["--reduce", "none"], "compute")
    # Streaming: f<F> fragments, d<D> delay.
    assert _codec_args("diloco16f4") == (
        ["--local-steps", "16", "--outer", "diloco", "--compression", "none", "--fragments",
         "4"], "diloco16f4")
    assert _codec_args("diloco16f4d2-int8") == (
        ["--local-steps", "16", "--outer", "diloco", "--compression", "int8", "--fragments",
         "4", "--delay", "2"], "diloco16f4d2-int8")
    for bad in ("diloco0", "diloco16-int4", "diloco", "slowmo-4", "localsgd4-none",
                "diloco16f0", "diloco16d2f4", "diloco16f"):
        assert _codec_args(bad) is None, bad


def test_train_bench_names_runs_without_error_feedback():
    # -noef after a lossy codec's name: the same options and --no-error-feedback.
    from herring_jax._src.tools.codec_names import codec_args
    assert codec_args("int8-noef") == (["--compression", "int8", "--no-error-feedback"],
                                       "int8-noef")
    assert codec_args("fully-reshard-int8-noef") == (
        ["--fully-sharded", "--compression", "int8", "--reshard-after-forward",
         "--no-error-feedback"], "fully-reshard-int8-noef")
    assert codec_args("diloco4-bf16-noef")[0][-1] == "--no-error-feedback"
    # Nothing lossy, nothing to turn off.
    for bad in ("none-noef", "sharded-noef", "fully-noef", "powersgd4-noef", "topk0.1-noef",
                "int8-noef-noef", "compute-noef"):
        assert codec_args(bad) is None, bad


def test_train_bench_runs_diloco_against_allreduce_and_compute(tmp_path):
    # 2 processes over the transport, a tiny model, 6 steps, a sync every 2:
    # the train_lm options reach herring_jax.diloco (the script reports the
    # name back), int8 pseudo-gradients every other step send far fewer bytes
    # than float32 gradients every step, and compute sends none of either.
    proc, runs = train_bench_codecs(tmp_path, "none,compute,diloco2-int8", steps=6)
    assert set(runs) == {"none", "compute", "diloco2-int8"}
    assert runs["diloco2-int8"]["bytes_reduction"] > 5, runs
    assert runs["compute"]["sent_mib_per_step"] < runs["diloco2-int8"]["sent_mib_per_step"]
    assert runs["diloco2-int8"]["held_out_loss"] != runs["none"]["held_out_loss"]
    assert "time to none's final held-out loss" in proc.stdout, proc.stdout
    assert all("time_to_none_loss_s" in r for r in runs.values()), runs
