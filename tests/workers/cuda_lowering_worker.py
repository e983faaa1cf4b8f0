"""What herring_jax emits for XLA:CUDA, read from the StableHLO text of
programs lowered for "cuda" on this CPU-only machine (jax lowers for a
platform without its devices or registered targets), and that the CPU
lowering is unchanged.

  split: the jitted training step (grad + allreduce_gradients) gets one start
    per bucket and one done per bucket; each done takes its own start's token
    first and every other start's token after it, so no done can precede the
    last start; no herring_allreduce call is left.
  cpu-in-place: the same step lowered for the CPU has one herring_allreduce
    call per bucket, each result aliasing its operand, then one herring_join
    that takes every bucket's result (aliased too) and no start or done;
    without the split (reductions bound one by one) there are the same calls
    with neither the aliases nor the join.
  direct: herring_jax.allreduce in jit lowers to a start followed by its done.
  halves: reduce_scatter, allgather and sharded_optimizer's step lower to the
    same starts and dones (collective attribute 1 and 2), every done paired
    with one start and carrying its start's key.
  pairs: in every CUDA program above and in a loop, an inlined helper called
    twice and a value_and_grad through the step, every done's first operand is
    a start's token and every start's token is the first operand of exactly one
    done.
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.transforms import fusion  # noqa: E402
from herring_jax._src.transforms import optax_transform  # noqa: E402

_CALL = re.compile(r"(%[\w#:]+) = stablehlo\.custom_call @(\w+)\(([^)]*)\)")
START, DONE, CPU = "herring_allreduce_start", "herring_allreduce_done", "herring_allreduce"
JOIN = "herring_join"


def call_lines(text: str, target: str) -> list[str]:
    """The text of every custom call to `target`, operands and attributes."""
    return [line for line in text.splitlines() if f"stablehlo.custom_call @{target}(" in line]


def custom_calls(text: str) -> list[tuple[str, str, list[str]]]:
    """(result, target, operands) of every custom call, in text order."""
    out = []
    for m in _CALL.finditer(text):
        result = m.group(1).split(":")[0]
        operands = [o.strip() for o in m.group(3).split(",") if o.strip()]
        out.append((result, m.group(2), operands))
    return out


def pairing_problems(calls) -> list[str]:
    starts = [r for r, t, _ in calls if t == START]
    dones = [ops for _, t, ops in calls if t == DONE]
    problems = []
    if any(t == CPU for _, t, _ in calls):
        problems.append("a CPU call in a CUDA program")
    firsts = [ops[0] if ops else None for ops in dones]
    for ops in dones:
        if not ops or not set(ops) <= set(starts):
            problems.append(f"a done reads something other than start tokens: {ops}")
    for s in starts:
        if firsts.count(s) != 1:
            problems.append(f"start {s} is the own token of {firsts.count(s)} dones")
    return problems


def key_problems(text: str) -> list[str]:
    """Dones whose key attribute is not their own start's."""
    keys, problems = {}, []
    for line in text.splitlines():
        m = _CALL.search(line)
        key = re.search(r"\bkey = (-?\d+)", line)
        if not m or m.group(2) not in (START, DONE) or not key:
            continue
        if m.group(2) == START:
            keys[m.group(1).split(":")[0]] = key.group(1)
            continue
        own = m.group(3).split(",")[0].strip()
        if keys.get(own) != key.group(1):
            problems.append(f"done key {key.group(1)}, its start's {keys.get(own)}")
    return problems


LAYERS, WIDTH = 4, 64


def loss(params, x):
    h = x
    for layer in params:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return jnp.mean(h ** 2)


def main() -> int:
    herring_jax.initialize()
    params = [{"w": jnp.full((WIDTH, WIDTH), 0.01), "b": jnp.zeros(WIDTH)}
              for _ in range(LAYERS)]
    x = jnp.ones((8, WIDTH))
    bucket_bytes = (WIDTH * WIDTH + 2 * WIDTH) * 4  # about one layer per bucket
    tx = herring_jax.allreduce_gradients(fusion_bytes=bucket_bytes,
                                         first_bucket_bytes=bucket_bytes)

    def step(p, x):
        updates, _ = tx.update(jax.grad(loss)(p, x), tx.init(p))
        return updates

    buckets = len(fusion.plan(jax.tree_util.tree_leaves(params), bucket_bytes, bucket_bytes))
    traced = jax.jit(step).trace(params, x)
    cuda_text = traced.lower(lowering_platforms=("cuda",)).as_text()
    cpu_text = traced.lower(lowering_platforms=("cpu",)).as_text()

    calls = custom_calls(cuda_text)
    starts = [r for r, t, _ in calls if t == START]
    dones = [ops for _, t, ops in calls if t == DONE]
    last_start = max(i for i, (_, t, _) in enumerate(calls) if t == START)
    first_done = min(i for i, (_, t, _) in enumerate(calls) if t == DONE)
    ok = (buckets >= 3 and len(starts) == buckets and len(dones) == buckets
          and all(sorted(ops) == sorted(starts) for ops in dones)
          and last_start < first_done and not pairing_problems(calls))
    common.report("split", ok, buckets=buckets, starts=len(starts), dones=len(dones),
                  problems=pairing_problems(calls))

    # The same step with every reduction bound on its own (no split).
    split = optax_transform.split_reductions
    optax_transform.split_reductions = lambda reduce, buffers: [reduce(b) for b in buffers]
    try:
        # A function of its own: jit's trace cache would hand back the split
        # program traced above for `step` itself.
        plain_text = jax.jit(lambda p, v: step(p, v)).trace(params, x).lower(
            lowering_platforms=("cpu",)).as_text()
    finally:
        optax_transform.split_reductions = split
    cpu_calls = custom_calls(cpu_text)
    targets = [t for _, t, _ in cpu_calls]
    reduced = [r for r, t, _ in cpu_calls if t == CPU]
    joined = [ops for _, t, ops in cpu_calls if t == JOIN]
    aliased = [("output_operand_aliases" in line) for line in
               call_lines(cpu_text, CPU) + call_lines(cpu_text, JOIN)]
    plain_targets = [t for _, t, _ in custom_calls(plain_text)]
    plain_aliased = any("output_operand_aliases" in line for line in call_lines(plain_text, CPU))
    common.report("cpu-in-place",
                  targets == [CPU] * buckets + [JOIN] and len(joined) == 1
                  and sorted(joined[0]) == sorted(reduced) and all(aliased)
                  and plain_targets == [CPU] * buckets and not plain_aliased,
                  targets=targets, joined=joined, reduced=reduced, aliased=aliased,
                  plain_targets=plain_targets, plain_aliased=plain_aliased)

    def direct(v):
        return herring_jax.allreduce({"a": v, "b": 2 * v, "empty": jnp.zeros(0)})

    direct_calls = custom_calls(
        jax.jit(direct).trace(jnp.ones(5)).lower(lowering_platforms=("cuda",)).as_text())
    common.report("direct",
                  [t for _, t, _ in direct_calls] == [START, DONE]
                  and direct_calls[1][2] == [direct_calls[0][0]],
                  calls=[t for _, t, _ in direct_calls])

    # The two halves lower to the same pair, the collective attribute saying
    # which; each done's key is its own start's (its handler checks that),
    # though its results are of another size than the start's operands.
    sharded_tx = herring_jax.sharded_optimizer(optax.sgd(0.1))

    def sharded_step(p, s, v):
        return sharded_tx.update(jax.grad(loss)(p, v), s, p)[0]

    halves = {
        "reduce_scatter": jax.jit(herring_jax.reduce_scatter).trace(jnp.ones(5)),
        "allgather": jax.jit(herring_jax.allgather).trace(jnp.ones(5)),
        "sharded_optimizer": jax.jit(sharded_step).trace(params, sharded_tx.init(params), x),
    }
    seen = {}
    for name, traced in halves.items():
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        calls = custom_calls(text)
        seen[name] = (sorted(set(re.findall(r"collective = (\d+)", text))),
                      pairing_problems(calls) + key_problems(text), len(calls))
    common.report("halves",
                  seen["reduce_scatter"][0] == ["1"] and seen["allgather"][0] == ["2"]
                  and seen["sharded_optimizer"][0] == ["1", "2"]
                  and not any(problems for _, problems, _ in seen.values())
                  and all(count >= 2 for _, _, count in seen.values()), seen=seen)

    @jax.jit
    def helper(v):
        return herring_jax.allreduce(v, op="mean")

    def loop(v):
        return jax.lax.fori_loop(0, 3, lambda i, c: herring_jax.allreduce(c), v)

    def vg(p, x):
        return jax.value_and_grad(lambda q: sum(
            jnp.sum(u) for u in jax.tree_util.tree_leaves(jax.jit(step)(q, x))))(p)

    programs = {
        "step": cuda_text,
        "loop": jax.jit(loop).trace(jnp.ones(4)).lower(lowering_platforms=("cuda",)).as_text(),
        "inlined": jax.jit(lambda v: helper(v) + helper(2 * v)).trace(jnp.ones(4)).lower(
            lowering_platforms=("cuda",)).as_text(),
        "value_and_grad": jax.jit(vg).trace(params, x).lower(
            lowering_platforms=("cuda",)).as_text(),
    }
    problems = {name: pairing_problems(custom_calls(text)) for name, text in programs.items()}
    counted = {name: len(custom_calls(text)) for name, text in programs.items()}
    common.report("pairs", not any(problems.values()) and all(counted.values()),
                  problems=problems, calls=counted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
