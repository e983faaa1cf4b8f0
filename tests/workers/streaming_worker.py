"""local_sgd with delay >= 1 across process lives: checkpoints and exits.

--phase save (first launch):
  trains local_sgd(every=4, fragments=2, delay=1) and saves the state after
  count 3 (nothing in flight) and after count 4 (fragment 0 in flight), and
  the parameters after count 9 (the run without a restart). Then each rank
  starts one more fragment (count 10): rank 1 shuts down at once and exits
  (os._exit after herring_jax.shutdown), rank 0 starts 2 s later and
  collects the result itself. Case
  "exit/peer-last-reduction": rank 0's reduction ends with the average of
  both ranks' pseudo-gradients, although rank 1 had left by then (its
  shutdown waits for its started reductions).
--phase resume (second launch, fresh processes):
  "resume/not-in-flight": restored at count 3 and trained to 9: bitwise the
    run without a restart.
  "resume/in-flight": restored at count 4 (fragment 0 in flight: its start
    ran in the first launch) and trained to 9: bitwise the run without a
    restart (the arrival re-issues the reduction from the state's copy of
    what was sent); local_sgd_in_flight says 4 is in flight and 3 is not;
    and a done handed that restored token directly (finish_reduction) fails
    with the error that names the ticket.
  "cuda/not-implemented": lowering the step for XLA:CUDA raises
    NotImplementedError naming the way out (delay=0).
  "two-optimizers/interleaved": two local_sgd's of equal shapes and
    schedules, each run alone and then in turn, end alike: each done takes
    its own start's result (the start's token, not the ticket, pairs them).
--phase every-step (one launch):
  "every-step/<config>": a short streaming run saved (host copies) after
    every step and resumed from each, with tokens that name no reduction of
    this engine any more: every resumed run ends bitwise where the run
    without a restart ends. Configs: every=4, fragments=2, delay=1; and
    every=6, fragments=2, delay=2, int8 with error feedback, mixing 0, a
    bfloat16 leaf beside the float32 ones.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.collectives import async_reduce  # noqa: E402
from herring_jax._src.transforms.streaming import fragment_leaves  # noqa: E402
from local_sgd_worker import FRAGMENT_SHAPES, flat, start_params, train_step  # noqa: E402

EVERY, FRAGMENTS, DELAY = 4, 2, 1


def make_tx():
    return herring_jax.local_sgd(optax.sgd(0.05, momentum=0.9), EVERY, fragments=FRAGMENTS,
                                 delay=DELAY)


def grads(rank, k, p):
    return {n: common.make_input("float32", v.size, rank, k).reshape(v.shape)
            + np.float32(0.5) * np.asarray(v) for n, v in p.items()}


def save(path, tree) -> None:
    np.savez(path, *[np.asarray(x) for x in jax.tree_util.tree_leaves(tree)])


def load(path, like):
    with np.load(path) as data:
        leaves = [jnp.asarray(data[f"arr_{i}"]) for i in range(len(data.files))]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


def phase_save(rank: int, root: str) -> None:
    tx = make_tx()
    step = train_step(tx)
    p = jax.tree_util.tree_map(jnp.asarray, start_params(FRAGMENT_SHAPES))
    state = tx.init(p)
    for k in range(9):
        p, state = step(grads(rank, k, p), state, p)
        if int(state.count) in (3, 4):
            save(os.path.join(root, f"r{rank}-c{int(state.count)}.npz"), (p, state))
    save(os.path.join(root, f"r{rank}-final.npz"), p)
    # Count 10 starts fragment 1 (phase 2): rank 1 leaves right after its start.
    if rank == 0:
        time.sleep(2.0)
    p, state = step(grads(rank, 9, p), state, p)
    # This rank's pseudo-gradient of fragment 1, synced - (p + u), up to rounding.
    of = fragment_leaves(p, FRAGMENTS)
    mine = np.concatenate([np.ravel(np.asarray(s) - np.asarray(x)) for s, x, f in zip(
        jax.tree_util.tree_leaves(state.synced), jax.tree_util.tree_leaves(p), of) if f == 1])
    np.save(os.path.join(root, f"pseudo-r{rank}.npy"), mine)
    if rank == 1:
        # Exits as soon as herring_jax lets it: skips jax.distributed's
        # shutdown barrier, which would otherwise hold it until rank 0 is done.
        herring_jax.shutdown()
        sys.stdout.flush()
        os._exit(0)
    like = [jax.ShapeDtypeStruct((x.size,), x.dtype)
            for x, f in zip(jax.tree_util.tree_leaves(p), of) if f == 1]
    # Fragment 1's float32 call: its start's token is in the state.
    got = jax.jit(lambda t, token: async_reduce.finish_reduction(t, token, like))(
        10, state.pending.tokens[1][0])
    got = np.concatenate([np.asarray(g) for g in got])
    want = (mine + np.load(os.path.join(root, "pseudo-r1.npy"))) / 2
    common.report("exit/peer-last-reduction", bool(np.allclose(got, want, rtol=1e-5, atol=1e-6)),
                  digest=common.digest(got), max_diff=float(np.max(np.abs(got - want))))
    herring_jax.shutdown()
    sys.stdout.flush()
    os._exit(0)  # rank 1 has gone without jax.distributed's barrier


def two_optimizers(rank: int) -> None:
    """Two local_sgd's of equal shapes and schedules, each run alone (the
    first leaves fragment 0 in flight at count 8, where the second starts its
    own fragment 0 under the same ticket), then both stepped in turn: their
    tokens keep the reductions apart, and each ends where it ended alone."""
    txs = [herring_jax.local_sgd(optax.sgd(lr), EVERY, fragments=FRAGMENTS, delay=DELAY)
           for lr in (0.05, 0.02)]
    steps = [train_step(tx) for tx in txs]
    start = jax.tree_util.tree_map(jnp.asarray, start_params(FRAGMENT_SHAPES))

    def run(which):
        ps = {w: start for w in which}
        states = {w: txs[w].init(start) for w in which}
        for k in range(8):
            for w in which:
                ps[w], states[w] = steps[w](grads(rank, k, ps[w]), states[w], ps[w])
        return {w: flat(ps[w]) for w in which}

    alone = {**run([0]), **run([1])}
    together = run([0, 1])
    ok = all(alone[w].tobytes() == together[w].tobytes() for w in (0, 1))
    common.report("two-optimizers/interleaved", ok and alone[0].tobytes() != alone[1].tobytes(),
                  digest=common.digest(together[0]))


def phase_resume(rank: int, root: str) -> None:
    two_optimizers(rank)
    tx = make_tx()
    step = train_step(tx)
    start = jax.tree_util.tree_map(jnp.asarray, start_params(FRAGMENT_SHAPES))
    like = (start, tx.init(start))
    p, state = load(os.path.join(root, f"r{rank}-c3.npz"), like)
    for k in range(3, 9):
        p, state = step(grads(rank, k, p), state, p)
    want = np.load(os.path.join(root, f"r{rank}-final.npz"))
    want = np.concatenate([np.ravel(want[f"arr_{i}"]) for i in range(len(want.files))])
    common.report("resume/not-in-flight", flat(p).tobytes() == want.tobytes(),
                  digest=common.digest(flat(p)))
    flags = [herring_jax.local_sgd_in_flight(c, EVERY, FRAGMENTS, DELAY) for c in (3, 4)]
    p, state = load(os.path.join(root, f"r{rank}-c4.npz"), like)
    stale = state.pending
    for k in range(4, 9):
        p, state = step(grads(rank, k, p), state, p)
    common.report("resume/in-flight", flat(p).tobytes() == want.tobytes() and
                  flags == [False, True], digest=common.digest(flat(p)), flags=flags)
    # The engine's own check, below local_sgd: a done handed a token of an
    # earlier life of the process is refused, naming the ticket.
    of = fragment_leaves(start, FRAGMENTS)
    like0 = [jax.ShapeDtypeStruct((x.size,), x.dtype)
             for x, f in zip(jax.tree_util.tree_leaves(start), of) if f == 0]
    error = ""
    try:
        jax.block_until_ready(jax.jit(lambda t, token: async_reduce.finish_reduction(
            t, token, like0))(4, stale.tokens[0][0]))
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        error = str(e)
    common.report("done/stale-token-refused",
                  "no reduction was started with ticket 4" in error and "checkpoint" in error,
                  error=error[:600])
    # XLA:CUDA has no handlers for a reduction across steps: refused when lowered.
    traced = jax.jit(lambda g, s, x: step(g, s, x)).trace(grads(rank, 4, p), state, p)
    why = ""
    try:
        traced.lower(lowering_platforms=("cuda",))
    except NotImplementedError as e:
        why = str(e)
    common.report("cuda/not-implemented", "XLA:CPU only" in why and "delay=0" in why, why=why)
    herring_jax.shutdown()


# A bfloat16 leaf travels in a call of its own, uncompressed (streaming.py).
MIXED_SHAPES = {"a": ((37,), jnp.float32), "b": ((5, 7), jnp.float32),
                "c": ((20,), jnp.bfloat16), "d": ((3, 4), jnp.float32)}


def every_step(rank: int) -> None:
    configs = {
        "f2d1": (4, dict(fragments=2, delay=1),
                 {k: (v, jnp.float32) for k, v in FRAGMENT_SHAPES.items()}, 9),
        "f2d2-int8-mixed": (6, dict(fragments=2, delay=2, compression="int8", mixing=0.0),
                            MIXED_SHAPES, 13),
    }
    for name, (every, kw, shapes, steps) in configs.items():
        tx = herring_jax.local_sgd(optax.adam(0.05), every, **kw)
        step = train_step(tx)
        rng = np.random.default_rng(7)
        p = {k: jnp.asarray(rng.normal(size=shape).astype(np.float32)).astype(dtype)
             for k, (shape, dtype) in sorted(shapes.items())}

        def g(k, p):
            return {n: (common.make_input("float32", v.size, rank, k).reshape(v.shape)
                        + np.float32(0.5) * np.asarray(v, np.float32)).astype(v.dtype)
                    for n, v in p.items()}

        state = tx.init(p)
        saved = []
        for k in range(steps):
            p, state = step(g(k, p), state, p)
            # Host copies: what a checkpoint holds.
            saved.append(jax.tree_util.tree_map(np.array, (p, state)))
        want = flat(p).tobytes()
        wrong = []
        for k, was in enumerate(saved[:-1]):
            p, state = jax.tree_util.tree_map(jnp.asarray, was)
            for j in range(k + 1, steps):
                p, state = step(g(j, p), state, p)
            if flat(p).tobytes() != want:
                wrong.append(k + 1)
        in_flight = [c for c in range(1, steps)
                     if herring_jax.local_sgd_in_flight(c, every, kw["fragments"], kw["delay"])]
        common.report(f"every-step/{name}", not wrong and bool(in_flight), wrong=wrong,
                      in_flight=in_flight, steps=steps)
    herring_jax.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "resume", "every-step"], required=True)
    parser.add_argument("--dir", help="--phase save and resume: where the states go")
    args = parser.parse_args()
    herring_jax.initialize()
    rank = herring_jax.process_index()
    if args.phase == "every-step":
        every_step(rank)
    else:
        (phase_save if args.phase == "save" else phase_resume)(rank, args.dir)


if __name__ == "__main__":
    main()
