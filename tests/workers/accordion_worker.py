"""herring_jax.accordion on several processes.

Cases (--cases, comma-separated):
  schedule<I>: interval I. light = allreduce_gradients() (the mean), heavy =
    allreduce_gradients(average=False) (the sum), so each update's result
    says which branch ran. Rank r's gradient is s_t (1 + r) on every
    element, s_t a power of two that changes often, so every reduced value,
    accumulated sum and norm is exact in float32 and a numpy model of the
    rule (accordion.light_next) predicts every decision, counter and norm
    bitwise. The scales switch the branch at most boundaries (many switches:
    the cond's reductions must stay paired on every rank).
  resume: the schedule pair; a state saved after some steps (through numpy,
    as a checkpoint does) and restored into a new transformation gives the
    same next decisions and results as the run that went on, and a fresh
    state gives others.
  codecs, powersgd, topk: light / heavy = allreduce_gradients bf16 / int8,
    powersgd rank 4 / 1, topk 0.1 / 0.01 (run with HERRING_HOST_STAGE=0, so
    that the codecs apply between the two processes). Each update is
    compared bitwise with the chosen transformation alone, run on the
    accordion's own inner state; at a switch the residual moves to the
    branch entered; the bytes this process sends per update are larger in
    light updates than in heavy ones.

Every case reports a digest of its decisions and results, which the test
compares across ranks.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.transforms.accordion import light_next  # noqa: E402

ETA = 0.5
# 64 elements in all: the norm of a constant v is 8 |v|, exact.
SHAPES = {"v": (4, 12), "w": (16,)}
# s_t, per pair of steps: steady, jumps up 8x, steady, drops, halves. The
# branch itself moves the norm too (the sum is n times the mean), so that a
# steady scale already switches: light, light, heavy (the same norm), light
# (doubled), light (halved: a change of exactly eta), heavy, ...
SCALES = (1.0, 1.0, 1.0, 8.0, 8.0, 8.0, 1.0, 1.0, 0.5)


def scale(step: int) -> float:
    return SCALES[(step // 2) % len(SCALES)]


def exact_grads(rank: int, step: int) -> dict:
    return {k: jnp.full(s, scale(step) * (1 + rank), jnp.float32) for k, s in SHAPES.items()}


def schedule_pair():
    return (herring_jax.allreduce_gradients(), herring_jax.allreduce_gradients(average=False))


def model(steps: int, interval: int, nproc: int, start=None):
    """The rule in numpy for the schedule pair: per step (use_light before
    it, the result's value, the state's norm after it, its counters, use_light
    after it). `start`: (use_light, norm, accumulated value, light steps,
    heavy steps, first step) of a saved state; None: a fresh one."""
    start = start or (True, np.float32(0), np.float32(0), 0, 0, 0)
    use_light, norm, acc, n_light, n_heavy, first = start
    out = []
    for t in range(first, first + steps):
        total = np.float32(sum(scale(t) * (1 + r) for r in range(nproc)))
        value = total / np.float32(nproc) if use_light else total
        acc = np.float32(acc + np.float32(value))
        n_light, n_heavy = n_light + use_light, n_heavy + (not use_light)
        before = use_light
        if (t + 1) % interval == 0:
            now = np.float32(8.0 * abs(float(acc)))  # 64 equal elements
            use_light = bool(light_next(norm, now, ETA))
            norm, acc = now, np.float32(0)
        out.append((before, np.float32(value), norm, n_light, n_heavy, use_light))
    return out


def observed(state, out) -> tuple:
    return (bool(state.use_light), float(state.norm), int(state.light_steps),
            int(state.heavy_steps), np.asarray(out["w"]))


def check_schedule(interval: int, rank: int, nproc: int, steps: int) -> None:
    light, heavy = schedule_pair()
    tx = herring_jax.accordion(light, heavy, interval=interval, eta=ETA)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    state = tx.init(params)
    update = jax.jit(tx.update)
    want = model(steps, interval, nproc)
    switches = sum(a[0] != b[0] for a, b in zip(want, want[1:]))
    ok, trail = switches >= steps // (3 * interval), []
    for t, (before, value, norm, n_light, n_heavy, after) in enumerate(want):
        ran_light = bool(state.use_light)
        out, state = update(exact_grads(rank, t), state)
        use_light, got_norm, got_light, got_heavy, w = observed(state, out)
        step_ok = (ran_light == before and np.all(w == value) and got_norm == norm
                   and (got_light, got_heavy) == (n_light, n_heavy) and use_light == after
                   and int(state.step) == t + 1)
        if not step_ok:
            common.report(f"schedule{interval}-step{t}", False, ran_light=ran_light,
                          want_light=before, value=float(w[0]), want_value=float(value),
                          norm=got_norm, want_norm=float(norm), counters=[got_light, got_heavy],
                          want_counters=[n_light, n_heavy])
        ok &= bool(step_ok)
        trail.append((ran_light, w.tobytes(), got_norm))
    common.report(f"schedule{interval}", ok, switches=switches,
                  digest=hashlib.sha256(repr(trail).encode()).hexdigest()[:16])


def as_saved(tree):
    """A checkpoint's round trip: host numpy arrays, then device arrays."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x)), tree)


def check_resume(rank: int, nproc: int) -> None:
    interval, first, more = 2, 7, 8
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}

    def run(tx, state, start):
        update, trail = jax.jit(tx.update), []
        for t in range(start, start + more):
            out, state = update(exact_grads(rank, t), state)
            trail.append((bool(state.use_light), np.asarray(out["w"]).tobytes(),
                          float(state.norm)))
        return trail

    tx = herring_jax.accordion(*schedule_pair(), interval=interval, eta=ETA)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t in range(first):
        _, state = update(exact_grads(rank, t), state)
    saved = jax.tree_util.tree_map(np.asarray, state)
    went_on = run(tx, state, first)
    resumed_tx = herring_jax.accordion(*schedule_pair(), interval=interval, eta=ETA)
    resumed = run(resumed_tx, as_saved(saved), first)
    fresh = run(resumed_tx, resumed_tx.init(params), first)
    # The model from the saved state agrees too.
    start = (bool(saved.use_light), np.float32(saved.norm), np.float32(saved.accumulated["w"][0]),
             int(saved.light_steps), int(saved.heavy_steps), first)
    want = [m[5] for m in model(more, interval, nproc, start)]
    ok = (resumed == went_on and [r[0] for r in resumed] == want
          and [f[0] for f in fresh] != want)
    common.report("resume", ok, resumed=[r[0] for r in resumed], went_on=[r[0] for r in went_on],
                  fresh=[f[0] for f in fresh], want=want,
                  digest=hashlib.sha256(repr(resumed).encode()).hexdigest()[:16])


PAIRS = {
    "codecs": lambda: (herring_jax.allreduce_gradients(compression="bf16"),
                       herring_jax.allreduce_gradients(compression="int8")),
    "powersgd": lambda: (herring_jax.powersgd(4), herring_jax.powersgd(1)),
    "topk": lambda: (herring_jax.topk(0.1), herring_jax.topk(0.01)),
}
PAIR_SHAPES = {"m": (64, 48), "b": (48,)}


def pair_grads(rank: int, step: int) -> dict:
    """A direction per rank plus a little that changes every step, times a
    scale per interval of 2 that stays, jumps 16x and stays: light, light
    (nothing to compare with), heavy, light, heavy, light, heavy."""
    s = (1.0, 1.0, 1.0, 16.0, 16.0, 1.0, 1.0)[min(step // 2, 6)]
    out = {}
    for k, shape in PAIR_SHAPES.items():
        i = np.arange(int(np.prod(shape)), dtype=np.float64)
        g = np.sin(i * 0.37 + rank) + 0.2 * np.cos(i * 0.11 * (step + 1))
        out[k] = jnp.asarray((s * g).astype(np.float32).reshape(shape))
    return out


def tree_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(common.bitwise_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb))


def check_pair(name: str, rank: int, steps: int = 12) -> None:
    light, heavy = PAIRS[name]()
    tx = herring_jax.accordion(light, heavy, interval=2, eta=ETA)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in PAIR_SHAPES.items()}
    state = tx.init(params)
    update = jax.jit(tx.update)
    alone = {True: jax.jit(light.update), False: jax.jit(heavy.update)}
    ok, trail, sent = True, [], {True: [], False: []}
    for t in range(steps):
        g = pair_grads(rank, t)
        ran_light = bool(state.use_light)
        # Waited for, so that its bytes are not counted as the update's.
        want_out, want_inner = jax.block_until_ready(
            alone[ran_light](g, state.light if ran_light else state.heavy))
        other = state.heavy if ran_light else state.light
        before = herring_jax.stats()["bytes_sent"]
        out, state = jax.block_until_ready(update(g, state))
        sent[ran_light].append(herring_jax.stats()["bytes_sent"] - before)
        got_inner, got_other = ((state.light, state.heavy) if ran_light
                                else (state.heavy, state.light))
        out_ok = tree_equal(out, want_out)
        if bool(state.use_light) == ran_light:
            # No switch: the branch that ran holds what it alone gives; the
            # other is untouched.
            state_ok = tree_equal(got_inner, want_inner) and tree_equal(got_other, other)
        else:
            # A switch: the residuals moved into the branch entered.
            moved = jax.tree_util.tree_map(lambda a, b: a + b if a.shape == b.shape else b,
                                           want_inner.residual, other.residual)
            zeros = jax.tree_util.tree_map(
                lambda a, b: jnp.zeros_like(a) if a.shape == b.shape else a,
                want_inner.residual, other.residual)
            state_ok = (tree_equal(got_other.residual, moved)
                        and tree_equal(got_inner.residual, zeros)
                        and any(np.any(np.asarray(x)) for x in jax.tree_util.tree_leaves(
                            got_other.residual)))
        if not (out_ok and state_ok):
            common.report(f"{name}-step{t}", False, out_ok=out_ok, state_ok=state_ok,
                          ran_light=ran_light)
        ok &= out_ok and state_ok
        trail.append((ran_light, [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(out)]))
    decisions = [r for r, _ in trail]
    light_bytes, heavy_bytes = np.median(sent[True]), np.median(sent[False])
    # Both branches ran, switching both ways, and light sends more.
    ok &= (decisions.count(False) >= 2 and decisions.count(True) >= 4
           and light_bytes > 1.5 * heavy_bytes)
    common.report(name, ok, decisions=decisions, light_bytes=float(light_bytes),
                  heavy_bytes=float(heavy_bytes),
                  digest=hashlib.sha256(repr(trail).encode()).hexdigest()[:16])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="schedule1,schedule3,resume")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    herring_jax.initialize()
    rank, nproc = jax.process_index(), jax.process_count()
    for case in args.cases.split(","):
        if case.startswith("schedule"):
            check_schedule(int(case[len("schedule"):]), rank, nproc, args.steps)
        elif case == "resume":
            check_resume(rank, nproc)
        else:
            check_pair(case, rank)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
