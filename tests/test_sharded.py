"""sharded_optimizer: the same parameters as optax.chain(allreduce_gradients(),
inner) on every process (bitwise for element-wise inner transformations),
1/N of the optimizer state, and the transformations it cannot run refused at
init (its checkpoints: test_sharded_checkpoint.py).

The bitwise comparisons run with XLA_FLAGS=--xla_backend_optimization_level=0:
with LLVM's optimizations XLA:CPU contracts a multiply and an add of one
fused loop into one fused multiply-add, and the two programs fuse the
optimizer's last step with apply_updates differently (the sharded one's
all-gather stands between them), which changes last bits of some elements
while the updates themselves are bitwise equal (README, "Sharded optimizer").
"""

import pytest

from multiproc import BITWISE_COMPILE, assert_all_ok, launch

BITWISE = {"XLA_FLAGS": BITWISE_COMPILE}


def _cases(run):
    return {r["case"]: r for r in run.results[0]}


@pytest.mark.parametrize("nproc,hosts", [(2, None), (4, 2)])
def test_the_parameters_match_the_unsharded_chain_on_every_process(nproc, hosts):
    # Every inner transformation on 2 processes (float32); on 4 (2 simulated
    # hosts x 2 processes: the host stage and the transport) the ones with
    # state of their own, weight decay and the global norm, in float32 and
    # bfloat16.
    args = (["--refused", "--dtypes", "float32"] if nproc == 2
            else ["--inners", "nesterov,adamw-masked,schedule,clip+adamw"])
    run = launch("sharded_worker.py", args, nproc=nproc, hosts=hosts, env=BITWISE, timeout=900)
    digests = assert_all_ok(run)
    # Every process ends with the same parameters.
    assert all(len(d) == 1 for d in digests.values()), digests
    cases = _cases(run)
    # Process 0 checked each inner transformation once; the others took its
    # verdicts, the refusals (nproc 2) among them.
    ran = cases["verdicts"]["ran"]
    assert ran >= (5 if nproc == 2 else 2), cases["verdicts"]
    assert all(r["case"] != "verdicts" or (r["ran"], r["taken"]) == (0, ran)
               for rank, results in run.results.items() if rank > 0 for r in results), run.results
    if nproc == 4:
        # adamw's state per process: a quarter of the unsharded one, plus
        # the chunks' padding and adam's step count.
        adamw = cases["float32/adamw-masked"]
        assert adamw["state_bytes"] <= 0.26 * adamw["unsharded_state_bytes"], adamw


def test_inside_shard_map_each_device_keeps_a_quarter():
    # 2 processes x 2 devices, allreduce_gradients('d') against
    # sharded_optimizer(inner, 'd'), the state sharded over 'd'.
    run = launch("sharded_worker.py", ["--mesh", "--dtypes", "float32",
                                       "--inners", "adamw-masked,clip+adamw"],
                 nproc=2, devices=2, env=BITWISE, timeout=600)
    digests = assert_all_ok(run, expected_cases=3)  # the two inners and the verdicts
    assert all(len(d) == 1 for d in digests.values()), digests
    adamw = _cases(run)["float32/adamw-masked"]
    # Per device: a quarter of the state (4 devices), plus padding and counts.
    assert adamw["state_bytes"] <= 0.26 * adamw["unsharded_state_bytes"], adamw


def test_a_jitted_init_compiles_one_program_on_every_process():
    # sharded_optimizer's and topk's init inside jax.jit beside herring
    # reductions (the user's, or optax.tree.norm's inside the inner init):
    # the rank must be a value of the program, not a constant, or each
    # process compiles its own program and the reductions never pair (the
    # job then hung until HERRING_TIMEOUT_S).
    run = launch("jitted_init_worker.py", [], nproc=2, env={"HERRING_TIMEOUT_S": "40"},
                 timeout=120)
    assert_all_ok(run, expected_cases=3)
    assert [r["shard"] for r in _cases(run).values()] == [0, 0, 0]


def test_the_inner_check_runs_once_for_one_transformation_and_shapes(monkeypatch):
    # Compiling the check is most of init's time: an init traced again (in
    # another jitted function, by a restore) reuses the verdict. Another
    # worker count is checked anew, and a transformation that fails is
    # refused every time.
    import numpy as np
    import optax

    from herring_jax._src.transforms import sharded_checks

    runs = []
    real = sharded_checks._run_check
    monkeypatch.setattr(sharded_checks, "_run_check",
                        lambda *a: (runs.append(a[2]), real(*a))[1])
    monkeypatch.setattr(sharded_checks, "_passed", {})
    inner = optax.sgd(0.1, momentum=0.9)
    params = {"w": np.ones((5, 3), np.float32), "b": np.ones(3, np.float32)}
    for _ in range(2):
        sharded_checks.check_elementwise(inner, params, 2)
    assert runs == [2], runs
    sharded_checks.check_elementwise(inner, params, 3)
    assert runs == [2, 3], runs
    whole = optax.scale_by_trust_ratio()  # looks at whole leaves
    for _ in range(2):
        with pytest.raises(ValueError, match="element by element"):
            sharded_checks.check_elementwise(whole, params, 2)
    assert runs == [2, 3, 2, 2], runs
