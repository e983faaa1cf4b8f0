"""allreduce_gradients(sparse_rows=...): row-sparse leaves reduced by
gathering only the touched rows, bitwise the dense reduction on every rank
(tests/workers/sparse_rows_worker.py), and its arguments refused clearly."""

import numpy as np
import optax
import pytest

import herring_jax
from multiproc import assert_all_ok, launch

EAGER = [f"eager/{{d}}/{op}/{how}" for op in ("mean", "sum") for how in ("found", "given")]
CASES = ([c.format(d="float32") for c in EAGER] + ["given-equals-found"]
         + [c.format(d="bfloat16") for c in EAGER] + ["eager-fallback"]
         + [f"jit-fallback/step{t}" for t in range(6)] + ["flax/found", "flax/given"])


@pytest.mark.parametrize("nproc,hosts", [(3, None), (4, 2)], ids=["3", "2x2"])
def test_sparse_rows_equal_the_dense_reduction_bitwise(nproc, hosts):
    # 2x2: two simulated hosts of two processes, whose dense sum is
    # (x0 + x1) + (x2 + x3): the sparse sum follows that order.
    run = launch("sparse_rows_worker.py", [], nproc=nproc, hosts=hosts)
    digests = assert_all_ok(run, expected_cases=len(CASES))
    results = run.results[0]
    assert [r["case"] for r in results] == CASES
    # Every rank holds the same bits.
    assert all(len(v) == 1 for v in digests.values()), digests
    eager = {r["case"]: r for r in results if r["case"].startswith("eager/float32")}
    for r in eager.values():
        # -0.0 where every contribution was -0.0 (row 31); +0.0 where one
        # rank's -0.0 met the others' +0.0 (rows 30, 32), as the dense sum.
        assert r["neg_zero_rows"] == [31], r
        assert r["untouched_zero"], r
    # The over-bound steps took the dense branch: the whole table (48 x 6
    # float32) was reduced on top of the gather, which every step spends.
    steps = [r for r in results if r["case"].startswith("jit-fallback")]
    under = {r["bytes_reduced"] for r in steps if not r["over"]}
    over = {r["bytes_reduced"] for r in steps if r["over"]}
    assert len(under) == 1 and len(over) == 1, steps
    assert over.pop() - under.pop() == 48 * 6 * 4, steps


def test_sparse_rows_arguments_are_refused_with_what_to_do():
    emb = lambda path, g: True  # noqa: E731
    with pytest.raises(ValueError, match="without sparse_rows"):
        herring_jax.allreduce_gradients(sparse_max_rows=8)
    with pytest.raises(NotImplementedError, match="axis_name=None"):
        herring_jax.allreduce_gradients("d", sparse_rows=emb)
    with pytest.raises(ValueError, match="compression"):
        herring_jax.allreduce_gradients(sparse_rows=emb, compression="bf16")
    with pytest.raises(ValueError, match="weight"):
        herring_jax.allreduce_gradients(sparse_rows=emb, weight=True)
    for bad, err in ((0, ValueError), (1.5, ValueError), ("8", TypeError), (True, TypeError)):
        with pytest.raises(err, match="sparse_max_rows"):
            herring_jax.allreduce_gradients(sparse_rows=emb, sparse_max_rows=bad)
    with pytest.raises(NotImplementedError, match="allreduce_gradients.sparse_rows"):
        herring_jax.sharded_optimizer(optax.sgd(0.1), sparse_rows=emb)
    # row_ids= to a transformation without sparse rows would be dropped.
    g = {"emb": np.ones((4, 2), np.float32)}
    tx = herring_jax.allreduce_gradients()
    with pytest.raises(TypeError, match="row_ids= but the transformation has no row-sparse"):
        tx.update(g, tx.init(g), row_ids=np.array([1]))


def test_sparse_rows_masks_and_bounds(monkeypatch):
    from herring_jax._src.transforms import sparse_rows as sparse_lib
    g = {"emb": np.zeros((100, 4), np.float32), "step": np.zeros((), np.int32),
         "w": {"a": np.zeros(3, np.float32), "b": np.zeros(3, np.float32)}}
    pick = lambda path, leaf: "emb" in str(path)  # noqa: E731
    assert sparse_lib.leaf_flags(pick, g, "t") == [True, False, False, False]
    assert sparse_lib.leaf_flags({"emb": True, "step": False, "w": True}, g, "t") == [
        True, False, True, True]
    with pytest.raises(TypeError, match=r"\['step'\] \(int32\[\]\).*floating array"):
        sparse_lib.leaf_flags({"emb": True, "step": True, "w": False}, g, "t")
    with pytest.raises(ValueError, match="does not fit"):
        sparse_lib.leaf_flags({"emb": True}, g, "t")
    assert sparse_lib.bound(0.02, 131072) == 2622
    assert sparse_lib.bound(10, 4) == 4 and sparse_lib.bound(None, 160) == 10
    # The knob, when the argument is None: rows, or a share with a point.
    monkeypatch.setenv("HERRING_SPARSE_MAX_ROWS", "0.5")
    assert sparse_lib.bound(None, 160) == 80 and sparse_lib.bound(7, 160) == 7
    monkeypatch.setenv("HERRING_SPARSE_MAX_ROWS", "12")
    assert sparse_lib.bound(None, 160) == 12
    monkeypatch.setenv("HERRING_SPARSE_MAX_ROWS", "2.5")
    with pytest.raises(ValueError, match=r"HERRING_SPARSE_MAX_ROWS='2.5' is invalid"):
        sparse_lib.bound(None, 160)
    with pytest.raises(ValueError, match="one per row-sparse leaf"):
        sparse_lib.step_ids({"row_ids": [np.array([1])]}, 2, "t")
    with pytest.raises(TypeError, match="integer row ids"):
        sparse_lib.step_ids({"row_ids": np.array([1.0])}, 1, "t")


def test_the_numpy_model_starts_from_the_first_contribution():
    # -0.0 + -0.0 stays -0.0 (a sum from 0.0 would give +0.0), and two hosts
    # of two processes sum (x0 + x1) + (x2 + x3), not in rank order.
    from herring_jax._src.transforms import sparse_rows as sparse_lib
    z = np.array([[-0.0]], np.float32)
    assert np.signbit(sparse_lib.model_np([z, z], [[0], [1]], False)).all()
    assert not np.signbit(sparse_lib.model_np([z, np.zeros_like(z)], [[0], [1]], False)).any()
    x = [np.array([[v]], np.float32) for v in (1e8, 1.0, -1e8, 1.0)]
    flat = sparse_lib.model_np(x, [[0], [1], [2], [3]], False)
    hosts = sparse_lib.model_np(x, [[0, 1], [2, 3]], False)
    assert flat[0, 0] == 1.0 and hosts[0, 0] == 0.0


def test_the_recommendation_example_ends_alike_with_sparse_rows():
    # examples/train_recsys.py: --sparse sends fewer bytes (over the
    # transport: HERRING_HOST_STAGE=0) and ends at the same held-out loss.
    import os
    import re
    import subprocess
    import sys
    from multiproc import FAST_COMPILE, ROOT
    done = {}
    for flag in ([], ["--sparse"]):
        env = dict(os.environ, JAX_PLATFORMS="cpu", HERRING_TIMEOUT_S="120",
                   HERRING_HOST_STAGE="0", XLA_FLAGS=FAST_COMPILE)
        proc = subprocess.run(
            [sys.executable, "-m", "herring_jax.launch", "-n", "2", "--timeout", "300", "--",
             sys.executable, "train_recsys.py", "--items", "8192", "--steps", "4",
             "--batch", "16", *flag], cwd=ROOT / "examples", env=env, capture_output=True,
            text=True, timeout=330)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        [line] = [l for l in proc.stdout.splitlines() if "done:" in l]
        m = re.search(r"held-out loss ([\d.]+), .* sent ([\d.]+) MiB", line)
        done[bool(flag)] = (m.group(1), float(m.group(2)))
    assert done[True][0] == done[False][0], done
    assert done[True][1] < done[False][1] / 4, done


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_jitted_row_sum_is_the_numpy_model_bitwise(dtype):
    # sum_rows on made-up gathered packs of 4 processes, under jit, against
    # the dense model: flat and as two hosts of two, sum and mean (a
    # division by 3 and 4 processes is not a product with the reciprocal).
    import jax
    import ml_dtypes
    from herring_jax._src.transforms import sparse_rows as sparse_lib
    np_dtype = np.dtype(np.float32) if dtype == "float32" else np.dtype(ml_dtypes.bfloat16)
    v, d, k = 40, 8, 9
    rng = np.random.RandomState(3)
    for order in ([[0], [1], [2]], [[0], [1], [2], [3]], [[0, 1], [2, 3]]):
        p = sum(len(m) for m in order)
        ids = np.full((p, k), v, np.int32)
        rows = np.zeros((p, k, d), np_dtype)
        tables = []
        for r in range(p):
            mine = np.union1d([0, 1] if r == 0 else [0],
                              rng.choice(np.arange(2, v), rng.randint(0, k - 1), replace=False))
            vals = (rng.randn(len(mine), d) * 10.0 ** rng.randint(-3, 8, (len(mine), d)))
            vals[0, :2] = -0.0  # row 0, every process: -0.0 + -0.0 + ... stays -0.0
            vals[0, 2] = -0.0 if r != p - 1 else 0.0  # and +0.0 once makes it +0.0
            if r == 0:
                vals[1, 0] = -0.0  # row 1, rank 0 alone: -0.0 + 0.0 (untouched) is +0.0
            ids[r, :len(mine)] = mine
            rows[r, :len(mine)] = vals.astype(np_dtype)
            t = np.zeros((v, d), np_dtype)
            t[mine] = rows[r, :len(mine)]
            tables.append(t)
        for mean in (False, True):
            got = jax.jit(lambda i, x: sparse_lib.sum_rows(i, x, order, mean, v))(ids, rows)
            want = sparse_lib.model_np(tables, order, mean)
            assert np.asarray(got).tobytes() == want.tobytes(), (order, mean)
            assert np.signbit(want[0, :2].astype(np.float32)).all(), want[0]
            assert not np.signbit(want[0, 2].astype(np.float32)), want[0]
            assert not np.signbit(want[1, 0].astype(np.float32)), want[1]
