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
         + [c.format(d="bfloat16") for c in EAGER]
         + [f"jit-fallback/step{t}" for t in range(6)] + ["flax/found", "flax/given"])


def test_sparse_rows_equal_the_dense_reduction_bitwise_on_three_processes():
    run = launch("sparse_rows_worker.py", [], nproc=3)
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
