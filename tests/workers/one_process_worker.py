"""One process, jitted allreduce, for the GPU check (tests/gpu/run.sh; on
CPU devices in its dry run, tests/test_gpu_check.py): on XLA:CUDA each call
is a start and a done (cuda_handlers.cc), the smallest thing that runs them.

  <dtype>: 20 fresh inputs, dispatched back to back without waiting (the host
    runs ahead of the GPU, so several starts are in flight before any done),
    then each result compared bitwise with the numpy reference (one process:
    the input itself).
  tree: one call on a tree of several dtypes with an empty leaf (several
    operands of one start, and an operand the handlers never see), 20 times.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

INPUTS = 20
COUNT = 100_003  # not a multiple of any chunk or vector width


def main() -> int:
    jax.config.update("jax_enable_x64", True)  # float64 and int64 cases
    herring_jax.initialize()
    platform = jax.devices()[0].platform
    for dtype in common.NP_DTYPES:
        op = "sum" if dtype.startswith("int") else "mean"
        reduce = jax.jit(lambda x, op=op: herring_jax.allreduce(x, op=op))
        inputs = [common.make_input(dtype, COUNT, 0, salt) for salt in range(INPUTS)]
        start = time.monotonic()
        outs = [reduce(jax.device_put(x)) for x in inputs]
        got = [np.asarray(o) for o in outs]
        seconds = time.monotonic() - start
        bad = [i for i, (g, x) in enumerate(zip(got, inputs))
               if not common.bitwise_equal(g, common.reference(dtype, op, [[x]]))]
        common.report(dtype, not bad, op=op, wrong_inputs=bad, platform=platform,
                      ms_per_call=round(1000 * seconds / INPUTS, 2),
                      on=str(outs[0].devices()))

    def tree(salt):
        return {"a": common.make_input("float32", 1000, 0, salt),
                "b": common.make_input("bfloat16", 77, 0, salt),
                "c": common.make_input("int32", 5, 0, salt),
                "empty": np.zeros(0, np.float32)}

    reduce = jax.jit(herring_jax.allreduce)
    trees = [tree(salt) for salt in range(INPUTS)]
    outs = [reduce(t) for t in trees]
    ok = all(common.bitwise_equal(np.asarray(o[k]), t[k])
             for o, t in zip(outs, trees) for k in t)
    common.report("tree", ok, platform=platform)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
