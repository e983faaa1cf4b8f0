"""Resuming sharded_optimizer on another number of processes: phase `save`
trains STEPS steps on N processes and checkpoints (save_sharded), recording
every file each process writes while it saves; phase `resume`, on M
processes, restores each checkpoint named and trains STEPS more. The
unsharded chain (allreduce_gradients + inner) does the same from a checkpoint
of its own; both report their final parameters' digest."""

from __future__ import annotations

import argparse
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import common  # noqa: E402
import file_writes  # noqa: E402
import herring_jax  # noqa: E402
from sharded_worker import flat, loss_fn, make_params  # noqa: E402

STEPS = 3


def inner():
    return optax.adamw(optax.exponential_decay(1e-2, 1, 0.9), weight_decay=0.1)


def steps(tx, params, state, rank: int, first: int):
    @jax.jit
    def step(params, state, x):
        grads = jax.grad(loss_fn)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for k in range(first, first + STEPS):
        rng = np.random.default_rng(1000 * rank + k)
        params, state = step(params, state, rng.normal(size=(16, 37)).astype(np.float32))
    return params, state


def fully_steps(fs, state, rank: int, first: int):
    """fully_sharded's steps on the batches of `steps`."""
    @jax.jit
    def step(state, x):
        _, grads = fs.value_and_grad(loss_fn)(state, x)
        return fs.apply_gradients(state, grads)

    for k in range(first, first + STEPS):
        rng = np.random.default_rng(1000 * rank + k)
        state = step(state, rng.normal(size=(16, 37)).astype(np.float32))
    return state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["save", "resume"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--fully", action="store_true",
                        help="save: also a checkpoint of fully_sharded (named 'fully')")
    parser.add_argument("--names", default="sharded",
                        help="resume: the checkpoints (under --dir) to restore, comma-separated")
    args = parser.parse_args()
    herring_jax.initialize()
    rank = herring_jax.process_index()
    params = make_params(args.dtype)
    sharded = herring_jax.sharded_optimizer(inner())
    chain = optax.chain(herring_jax.allreduce_gradients(), inner())
    fully = herring_jax.fully_sharded(inner())
    ref_path = os.path.join(args.dir, "reference.pkl")
    if args.phase == "save":
        p_s, s_s = steps(sharded, params, sharded.init(params), rank, 0)
        p_r, s_r = steps(chain, params, chain.init(params), rank, 0)
        with file_writes.recording() as seen:
            herring_jax.save_sharded(os.path.join(args.dir, "sharded"), sharded, s_s, p_s)
        if rank == 0:
            with open(ref_path, "wb") as f:
                pickle.dump(jax.tree_util.tree_map(np.asarray, (p_r, s_r)), f)
        if args.fully:
            s_f = fully_steps(fully, fully.init(params), rank, 0)
            with file_writes.recording() as seen_f:
                herring_jax.save_sharded(os.path.join(args.dir, "fully"), fully, s_f)
            # Only this process's chunks were ever in its memory, and the
            # whole parameters gathered equal the sharded optimizer's.
            same = flat(jax.jit(fully.gather)(s_f)).tobytes() == flat(p_s).tobytes()
            common.report("save-fully", same, **seen_f)
        sizes = [int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves(s_s.inner)]
        common.report("save", True, digest=common.digest(flat(p_s)), state_bytes=sum(sizes),
                      **seen)
    else:
        with open(ref_path, "rb") as f:
            p_ref, s_ref = pickle.load(f)
        p_r, _ = steps(chain, p_ref, s_ref, rank, STEPS)
        b = flat(p_r)
        for name in args.names.split(","):
            if name == "fully":
                s_f = herring_jax.restore_sharded(os.path.join(args.dir, name), fully,
                                                  jax.eval_shape(lambda: params))
                s_f = fully_steps(fully, s_f, rank, STEPS)
                a = flat(jax.jit(fully.gather)(s_f))
                common.report(f"resume/{name}", a.tobytes() == b.tobytes(),
                              digest=common.digest(a), reference=common.digest(b),
                              max_diff=float(np.max(np.abs(a - b))))
                continue
            s_s, p_s = herring_jax.restore_sharded(os.path.join(args.dir, name), sharded, params)
            p_s, s_s = steps(sharded, p_s, s_s, rank, STEPS)
            a = flat(p_s)
            common.report(f"resume/{name}", a.tobytes() == b.tobytes(), digest=common.digest(a),
                          reference=common.digest(b), max_diff=float(np.max(np.abs(a - b))))
    herring_jax.shutdown()


if __name__ == "__main__":
    main()
