"""One rank of `herring-jax train-bench --overlap`: how much of the gradient
reduction the standard training step hides behind its backward pass.

The step is written the standard way: ``jax.value_and_grad`` and
``tx.update`` with ``optax.chain(herring_jax.allreduce_gradients(),
optax.sgd(...))`` in one ``jax.jit``. Measured in the same job, medians:
  compute    the same step without the reduction (optax.sgd alone)
  reduction  allreduce_gradients of the same gradients, alone
  step       the standard step
  hidden     (compute + reduction - step) / min(compute, reduction):
             1 when the shorter of the two is hidden entirely, 0 when the
             step costs their sum.
  bound      the hidden fraction of the best step this model allows: a
             step's reductions need that step's gradients, so none can start
             before the forward pass ends, and the step takes at least
             max(compute, forward + reduction).
  first gradient  the forward pass and the last layer's gradients alone (XLA
             prunes the rest of the backward pass): no reduction of a bucket
             of the last layer can start earlier, so with it in place of the
             forward pass the bound is what this model's dataflow allows.
  first      when the step's first reduction was issued, from the engine's
             timeline; with it in place of the forward pass the bound is what
             this step's schedule allowed (XLA places each reduction's call
             among the backward pass's operations).
It also checks that a step's reduced gradients are bitwise its local
gradients reduced outside the step, and writes every rank's
timeline (step boundaries from Python, each reduction's issue / start / end
from the engine) as JSON lines for the plot.

Run under `herring-jax launch`; prints `OVERLAP_RESULT {json}` on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--layers", type=int, default=8, help="Dense layers of the MLP")
    p.add_argument("--width", type=int, default=512, help="width of every layer")
    p.add_argument("--batch", type=int, default=1024, help="examples per process per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each kind")
    p.add_argument("--fusion-mib", type=float, default=None, help="fusion buffer size (MiB)")
    p.add_argument("--pin", action="store_true", help="pin each process to core rank %% CPUs")
    p.add_argument("--timeline", default=None, help="write this rank's timeline to PATH.rankR")
    p.add_argument("--fully-sharded", action="store_true",
                   help="the step is herring_jax.fully_sharded's (gathers in the forward "
                        "pass, reduce-scatters in the backward pass) instead")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.pin:
        rank = int(os.environ.get("HERRING_PROCESS_ID", "0"))
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import herring_jax
    from herring_jax._src.process import runtime

    herring_jax.initialize()
    me = herring_jax.process_index()
    key = jax.random.key(0)
    params = []
    for i in range(args.layers):
        key, k = jax.random.split(key)
        params.append({"w": jax.random.normal(k, (args.width, args.width)) / args.width ** 0.5,
                       "b": jnp.zeros(args.width)})
    rng = np.random.default_rng(me)
    x = jnp.asarray(rng.normal(size=(args.batch, args.width)).astype(np.float32))
    y = jnp.asarray(rng.normal(size=(args.batch, args.width)).astype(np.float32))

    def loss_fn(p, x, y):
        h = x
        for layer in p:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean((h - y) ** 2)

    kwargs = {} if args.fusion_mib is None else {"fusion_bytes": int(args.fusion_mib * 2**20)}
    reducer = herring_jax.allreduce_gradients(**kwargs)
    sgd = optax.sgd(1e-2)
    tx = optax.chain(reducer, sgd)

    @jax.jit
    def step(p, s, x, y):  # the standard way
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    if args.fully_sharded:
        fs = herring_jax.fully_sharded(sgd, **kwargs)

        @jax.jit
        def fully_step(p, s, x, y):  # p: the FullyShardedState, s unused
            loss, g = fs.value_and_grad(loss_fn)(p, x, y)
            return fs.apply_gradients(p, g), s, loss

    @jax.jit
    def checked_step(p, s, x, y):  # the same, also returning what it reduced
        _, g = jax.value_and_grad(loss_fn)(p, x, y)
        reduced, _ = reducer.update(g, reducer.init(g))
        u, s = sgd.update(reduced, s, p)
        return optax.apply_updates(p, u), s, g, reduced

    @jax.jit
    def compute_only(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = sgd.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    grads_of = jax.jit(jax.grad(loss_fn))
    forward = jax.jit(loss_fn)

    @jax.jit
    def first_gradient(p, x, y):  # the last layer's gradients only
        return jax.grad(lambda last: loss_fn(p[:-1] + [last], x, y))(p[-1])

    reduce_only = jax.jit(lambda g: reducer.update(g, reducer.init(g))[0])

    def timed(fn, n):
        times = []
        for _ in range(n):
            t0 = time.monotonic_ns()
            jax.block_until_ready(fn())
            times.append((time.monotonic_ns() - t0) / 1e6)
        return times

    state, sgd_state = tx.init(params), sgd.init(params)
    g0 = grads_of(params, x, y)
    # Warm up (compile) every function, then time each kind in turn.
    jax.block_until_ready((step(params, state, x, y), compute_only(params, sgd_state, x, y),
                           reduce_only(g0), forward(params, x, y),
                           first_gradient(params, x, y)))
    t_forward = timed(lambda: forward(params, x, y), args.steps)
    t_first_gradient = timed(lambda: first_gradient(params, x, y), args.steps)
    t_compute = timed(lambda: compute_only(params, sgd_state, x, y), args.steps)
    t_reduce = timed(lambda: reduce_only(g0), args.steps)
    runtime.take_timeline()  # forget the warm-up and the reduction-alone runs
    steps_log, p, s = [], params, state
    timed_step = step
    if args.fully_sharded:
        p, timed_step = fs.init(params), fully_step
        jax.block_until_ready(timed_step(p, s, x, y))
        runtime.take_timeline()
    for _ in range(args.steps):
        t0 = time.monotonic_ns()
        p, s, _ = jax.block_until_ready(timed_step(p, s, x, y))
        steps_log.append((t0, time.monotonic_ns()))
    events = runtime.take_timeline()
    from herring_jax._src.process import timeline as _timeline
    for e in events:
        # What each reduction was ("all_gather sum float32[...]", ...), for the plot.
        e["what"] = _timeline._labels.get((int(e.get("key", 0)), int(e.get("slot", 0))), "")
    t_step = [(b - a) / 1e6 for a, b in steps_log]

    # A step's reduced gradients are bitwise its local gradients reduced
    # outside the step (the same buffers, one call each).
    _, _, g, reduced = checked_step(params, sgd_state, x, y)
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(reduced), jax.tree.leaves(reduce_only(g))))

    if args.timeline:
        with open(f"{args.timeline}.rank{me}", "w") as f:
            for a, b in steps_log:
                f.write(json.dumps({"kind": "step", "start_ns": a, "end_ns": b}) + "\n")
            for e in events:
                f.write(json.dumps({"kind": "reduction", **e}) + "\n")

    compute, reduction, stepped, fwd, first_gradient_ms = (
        statistics.median(t) for t in (t_compute, t_reduce, t_step, t_forward, t_first_gradient))
    # Each step's first reduction issued, from the step's start.
    firsts = []
    for a, b in steps_log:
        issued = [e["issued_ns"] for e in events if a <= e["issued_ns"] < b]
        if issued:
            firsts.append((min(issued) - a) / 1e6)
    first = statistics.median(firsts) if firsts else float("nan")

    def bound_after(start_ms):
        return (compute + reduction - max(compute, start_ms + reduction)) / min(compute, reduction)

    hidden = (compute + reduction - stepped) / min(compute, reduction)
    bound = bound_after(fwd)
    nbytes = sum(int(np.prod(v.shape)) * 4 for v in jax.tree.leaves(params))
    # fully_sharded: how much of the gathers' time fell inside the forward
    # pass (from each step's start to the forward pass's median length).
    under = []
    for a, b in steps_log:
        for e in events:
            if a <= e["issued_ns"] < b and e["what"].startswith("all_gather"):
                lo, hi = e["begun_ns"], e["ended_ns"]
                if hi > lo:
                    under.append((min(hi, a + fwd * 1e6) - min(lo, a + fwd * 1e6)) / (hi - lo))
    result = {"rank": me, "processes": herring_jax.process_count(), "gradient_bytes": nbytes,
              "fully_sharded": args.fully_sharded,
              "gather_share_under_forward": statistics.mean(under) if under else float("nan"),
              "layers": args.layers, "width": args.width, "batch": args.batch,
              "compute_ms": compute, "forward_ms": fwd, "reduction_ms": reduction,
              "step_ms": stepped, "hidden_fraction": hidden, "hidden_fraction_bound": bound,
              "first_gradient_ms": first_gradient_ms,
              "hidden_fraction_bound_at_first_gradient": bound_after(first_gradient_ms),
              "first_issue_ms": first, "hidden_fraction_bound_at_first_issue": bound_after(first),
              "bitwise_equal_to_unoverlapped": same,
              "reductions_per_step": len(events) / max(1, args.steps)}
    print("OVERLAP_RESULT " + json.dumps(result), flush=True)
    herring_jax.shutdown()
    return 0 if same else 3


if __name__ == "__main__":
    sys.exit(main())
