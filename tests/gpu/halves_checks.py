"""The GPU check's steps for the two halves (reduce-scatter, all-gather) and
what is built on them; checks.py runs them as its own (`python
tests/gpu/checks.py halves`). New since the check last ran on a GPU: run.sh
marks their summary lines "[new]".

  halves: reduce_scatter (sum, mean) and allgather of 6 dtypes at sizes 1,
    1001 and 4099 (uneven parts) and the lax drop-ins in shard_map, 2 ranks,
    bitwise against numpy; every program lowered to the start/done pair.
  sharded-flax: sharded_optimizer and fully_sharded (adam) on a small Flax
    Linen MLP against optax.chain(allreduce_gradients(), adam), bitwise.
  halves-timing: herring's psum_scatter, all_gather and psum against
    jax.lax's on the same devices, 2 ranks sharing the GPU; a report, no
    target (NCCL may refuse two ranks on one GPU: then herring's times alone,
    with NCCL's error).

In the CPU dry run the first two go through the CPU double of the device
layer (HERRING_TEST_DEVICE_DOUBLE=1): the same handler code as on the GPU,
with the double's stream in place of CUDA's; the timing runs on XLA:CPU.
"""

from __future__ import annotations

from checks import GPU, judge, launch, summary

# tests/workers/device_halves_worker.py's collectives mode: 6 dtypes x 3 sizes
# x (reduce_scatter, + its mean for float32, allgather), the shard_map case;
# on the double also what it copied.
HALVES_CASES = 6 * 3 * 2 + 3 + 1
DOUBLE = {} if GPU else {"HERRING_TEST_DEVICE_DOUBLE": "1"}
# Sizes of the timing step, MiB (small on CPU: the dry run checks the step).
TIMING_MIB = "1,16,64" if GPU else "1,4"


def halves() -> int:
    run = launch("device_halves_worker.py", ["collectives"], 2, DOUBLE)
    where = "CUDA's start/done" if GPU else "the CPU double (dry run)"
    return summary(*judge(run, HALVES_CASES + (0 if GPU else 1),
                          f"reduce_scatter + allgather, 6 dtypes, uneven sizes, shard_map "
                          f"drop-ins, through {where}"))


def sharded_flax() -> int:
    run = launch("device_halves_worker.py", ["flax"], 2, DOUBLE)
    status, text = judge(run, 2, "sharded_optimizer and fully_sharded (adam) on a Flax MLP "
                         "= the unsharded chain, bitwise")
    if status == "FAIL" and run is not None:
        diffs = {c["case"]: c.get("max_diff") for c in run.results.get(0, [])}
        text = f"{text}; rank 0's max differences {diffs}"
    return summary(status, text)


def halves_timing() -> int:
    reps = "10" if GPU else "5"
    run = launch("halves_timing_worker.py", ["--mib", TIMING_MIB, "--reps", reps], 2)
    sizes = len(TIMING_MIB.split(","))
    status, _ = judge(run, sizes, "timing")
    if status == "FAIL":
        return summary(status, f"herring and lax timings not reported on both ranks "
                       f"(exit {run.returncode if run else 'timeout'})")
    parts, lax_error = [], None
    for row in run.results[0]:
        mib = row["case"].removeprefix("timing-")
        ops = []
        for op, short in (("psum_scatter", "rs"), ("all_gather", "ag"), ("psum", "ar")):
            mine, theirs = row[f"herring_{op}_ms"], row.get(f"lax_{op}_ms")
            ops.append(f"{short} {mine:g}" + (f"/{theirs:g} ({mine / theirs:.2f}x)"
                                              if theirs else ""))
        parts.append(f"{mib}: {', '.join(ops)}, copy both ways {row['copy_ms']:g}")
        lax_error = lax_error or row.get("lax_error")
    peer = (f"lax failed: {lax_error[:160]}" if lax_error else "herring/lax ms (ratio)")
    return summary(status, f"rank 0 median ms, {peer}: {'; '.join(parts)} (report only)")


STEPS = {
    "halves": halves,
    "sharded-flax": sharded_flax,
    "halves-timing": halves_timing,
}