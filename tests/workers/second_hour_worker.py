"""What a user meets in the second hour (issue "a user's second hour"): errors
that name the transformation they called and the leaf at fault.

Modes:
- transforms: every gradient transformation (allreduce_gradients,
  sharded_optimizer, powersgd, topk) given an integer gradient leaf raises
  TypeError naming itself and the leaf's path; given a misspelt mesh axis
  inside shard_map, NameError naming itself, the axis and the bound axes.
- lamb: sharded_optimizer(optax.lamb) refused at init on this many processes
  (one included), as on several.
- fail --rank R --where init|user --others sleep|reduce: rank R raises, at
  sharded_optimizer(optax.lamb)'s init or as plain user code (KeyError), while
  the others sleep (no reduction in flight) or wait in a reduction.
- steps: two jitted training steps with sharded_optimizer (run twice with
  jax's persistent compilation cache).
- stall --collective allreduce|reduce_scatter: rank 0 reduces float32[8] and
  rank 1 float32[12] (after 1.5 s), each at its own line below (marked
  "# stall: rank R's call"), and both wait.

Usage (under the launcher): python tests/workers/second_hour_worker.py MODE
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
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402

TRANSFORMS = {
    "allreduce_gradients": lambda axis=None: optax.chain(
        herring_jax.allreduce_gradients(axis), optax.adamw(1e-3)),
    "sharded_optimizer": lambda axis=None: herring_jax.sharded_optimizer(
        optax.adamw(1e-3), axis),
    "powersgd": lambda axis=None: herring_jax.powersgd(2, axis),
    "topk": lambda axis=None: herring_jax.topk(0.1, axis),
}


def expect(case: str, error: type, call, *words: str) -> None:
    """Reports whether call() raises `error` with every one of `words` in its text."""
    try:
        call()
        common.report(case, False, error="no error")
    except error as e:
        text = str(e)
        common.report(case, all(w in text for w in words), error=text,
                      missing=[w for w in words if w not in text])


def transforms() -> None:
    params = {"dense": {"kernel": jnp.ones((8, 8)), "bias": jnp.ones(8)}}
    grads = {"dense": {"kernel": jnp.ones((8, 8)), "bias": jnp.ones(8)},
             "step": jnp.ones((), jnp.int32)}
    with_step = dict(params, step=jnp.zeros((), jnp.int32))
    for name, make in TRANSFORMS.items():
        tx = make()

        def update(tx=tx):
            state = tx.init(with_step)
            return jax.jit(tx.update)(grads, state, with_step)
        expect(f"{name}: integer leaf", TypeError, update,
               f"herring_jax.{name}", "['step'] (int32)", "not floating point")

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    for name, make in TRANSFORMS.items():
        tx = make("dta")

        def step(tx=tx):
            def body(p):
                state = tx.init(p)
                updates, _ = tx.update(p, state, p)
                return updates
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(),
                                      check_vma=False))
            return f(jax.device_put(params, NamedSharding(mesh, P())))
        expect(f"{name}: misspelt axis", NameError, step,
               f"herring_jax.{name}('dta')", "['dta']", "['data']")


def lamb() -> None:
    params = {"w": jnp.ones((4, 6)), "b": jnp.ones(6)}
    expect(f"lamb on {herring_jax.process_count()} process(es)", ValueError,
           lambda: herring_jax.sharded_optimizer(optax.lamb(1e-3)).init(params),
           "does not treat its parameters element by element")


def fail(failing: int, where: str, others: str) -> None:
    params = {"w": jnp.ones((4, 6)), "b": jnp.ones(6)}
    if herring_jax.process_index() == failing:
        time.sleep(1.0)  # the others are asleep or waiting by now
        if where == "init":
            herring_jax.sharded_optimizer(optax.lamb(1e-3)).init(params)
        raise KeyError("a bug in the user's own code")
    if others == "reduce":
        jax.block_until_ready(herring_jax.allreduce(jnp.ones(8)))
    else:
        time.sleep(60)  # e.g. loading data: herring waits in nothing
    common.report("survived", False, error="the failing rank's error never reached this one")


def stall(collective: str) -> None:
    reduce = getattr(herring_jax, collective)
    if herring_jax.process_index() == 0:
        f, x = jax.jit(lambda x: reduce(x)), jnp.ones(8)  # stall: rank 0's call
    else:
        time.sleep(1.5)
        f, x = jax.jit(lambda x: reduce(x)), jnp.ones(12)  # stall: rank 1's call
    jax.block_until_ready(f(x))
    common.report("stall", False, error="the mismatched reduction returned")


def steps() -> None:
    tx = herring_jax.sharded_optimizer(optax.sgd(0.1))
    params = {"w": jnp.ones((16, 4)), "b": jnp.zeros(4)}
    state = tx.init(params)

    @jax.jit
    def step(p, s, x):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    for i in range(2):
        x = jnp.full((2, 16), float(herring_jax.process_index() + i))
        params, state = step(params, state, x)
    common.report("steps", True, digest=common.digest(np.asarray(params["w"])))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["transforms", "lamb", "fail", "stall", "steps"])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--where", choices=["init", "user"], default="user")
    parser.add_argument("--others", choices=["sleep", "reduce"], default="sleep")
    parser.add_argument("--collective", choices=["allreduce", "reduce_scatter"],
                        default="allreduce")
    args = parser.parse_args()
    herring_jax.initialize()
    if args.mode == "fail":
        fail(args.rank, args.where, args.others)
    elif args.mode == "stall":
        stall(args.collective)
    else:
        {"transforms": transforms, "lamb": lamb, "steps": steps}[args.mode]()
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
