"""Failures must raise HerringError on every surviving rank, never hang or
return a wrong sum.

  mismatch: two ranks reduce different shapes at the same call site: two
    different executables, so two identities that never match; both must fail
    within HERRING_TIMEOUT_S (the first to time out tells the other), naming
    both shapes.
  dead-peer: rank 1 leaves right after initialize(); rank 0 must fail within
    HERRING_PEER_TIMEOUT_S (heartbeats) or HERRING_TIMEOUT_S, naming rank 1.
  jit-dead-peer caught|uncaught: rank 1 leaves after two training steps whose
    gradients allreduce_gradients averages inside the user's jax.jit; rank 0
    must get HerringError naming rank 1: caught under herring_errors(), or
    uncaught, when the process must die printing herring_jax.HerringError.
  order: rank 0 reduces float32[100] then float32[200], rank 1 the other way
    round (each call waits for its result); both must fail within
    HERRING_TIMEOUT_S, each naming its own reduction and the peer's.
  codec-mismatch: both ranks reduce float32[1000], rank 0 with codec bf16,
    rank 1 uncompressed: as mismatch, naming the codec.
  absent-peer: rank 1 is alive but never reduces; rank 0's timeout must say
    that rank 1 is alive and in no reduction.
  killed-peer [uncaught]: rank 2 of 3 (one host) is SIGKILLed between
    reductions; what the others print of it must never call it alive.
    uncaught: the others die of their HerringError.
  error-types: rank 1 is alive but reduces no more; rank 0's reduction fails
    (HERRING_TIMEOUT_S), then every later one at once: reports, for each way
    a failure reaches a program, without and with herring_errors(), the
    exception's class.
  leader-fails-first: rank 0 (where jax's coordination service runs) fails
    uncaught; rank 1 takes 1 s to report the HerringError this causes, as on
    a loaded machine, and must still print it before the job ends.
  slow-peer: rank 1 starts its reduction long after rank 0 (more than
    HERRING_PEER_TIMEOUT_S later) but is alive: its heartbeats must keep
    rank 0 waiting, and the sum must be right.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402


def killed_peer(rank: int, caught: bool = True) -> None:
    import signal
    reduce = jax.jit(lambda x: herring_jax.allreduce(x * 2))
    if not caught:
        # The survivors die of the HerringError, printing what they print; a
        # step large enough that XLA runs it on its own threads, so that the
        # failure comes through jax's code, as a training step's does.
        w = jnp.full((32, 32), 0.01)
        step_fn = jax.jit(lambda x: jnp.tanh(herring_jax.allreduce(x * 2)) @ w)
        for step in range(200):
            jax.block_until_ready(step_fn(jnp.ones((32, 32))))
            if step == 3 and rank == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.02)
    try:
        with herring_jax.herring_errors():
            for step in range(200):
                jax.block_until_ready(reduce(jnp.ones(1000)))
                if step == 3 and rank == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.02)
    except herring_jax.HerringError as e:
        common.report("killed-peer", "rank 2" in str(e), message=str(e)[:600])
    else:
        common.report("killed-peer", False, message="no error")


def leader_fails_first(rank: int) -> None:
    reduce = jax.jit(lambda x: herring_jax.allreduce(x))
    jax.block_until_ready(reduce(jnp.ones(1000)))
    if rank == 0:
        raise RuntimeError("rank 0's own bug")
    try:
        for _ in range(3000):
            jax.block_until_ready(reduce(jnp.ones(1000)))
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - jax 0.10's dispatch path raises it as ValueError
        time.sleep(1.0)
        raise


def dead_peer(rank: int) -> None:
    if rank == 1:
        os._exit(0)  # exit 0 so that the launcher does not stop rank 0 itself
    start = time.monotonic()
    try:
        herring_jax.allreduce(np.ones(1000, np.float32))
    except herring_jax.HerringError as e:
        named = "rank(s) [1]" in str(e) or "rank 1" in str(e)
        common.report("dead-peer", named, seconds=time.monotonic() - start,
                      message=str(e)[:600])
    else:
        common.report("dead-peer", False, message="no error")


def slow_peer(rank: int, delay_s: float) -> None:
    if rank == 1:
        time.sleep(delay_s)
    start = time.monotonic()
    try:
        out = herring_jax.allreduce(np.full(1000, rank + 1, np.float32))
    except herring_jax.HerringError as e:
        common.report("slow-peer", False, message=str(e)[:600])
        return
    stats = herring_jax.stats()
    common.report("slow-peer", bool(np.all(np.asarray(out) == 3.0)),
                  seconds=time.monotonic() - start, heartbeats=stats["heartbeats_received"],
                  declared_dead=stats["peers_declared_dead"])


def jit_dead_peer(rank: int, mode: str) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    tx = optax.chain(herring_jax.allreduce_gradients(), optax.sgd(0.1))
    params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    x = jnp.full((8, 64), 0.01 * (rank + 1))
    for _ in range(2):
        params, opt_state = step(params, opt_state, x)
    jax.block_until_ready(params)
    # Rank 1 dies between steps: only once every rank has its second step's
    # result (a process that leaves while a peer still reads its slice fails
    # that peer's step instead, with another message).
    from herring_jax._src.process import jax_compat
    jax_compat.distributed_client().wait_at_barrier("jit-dead-peer-warm", 60_000)
    if rank == 1:
        sys.stdout.flush()
        os._exit(0)
    start = time.monotonic()
    if mode == "uncaught":
        params, opt_state = step(params, opt_state, x)
        jax.block_until_ready(params)  # raises: the process dies with a traceback
        common.report("jit-dead-peer", False, message="no error")
        return
    try:
        with herring_jax.herring_errors():
            for _ in range(3):
                params, opt_state = step(params, opt_state, x)
            float(params["b"][0])
    except herring_jax.HerringError as e:
        common.report("jit-dead-peer", "rank 1" in str(e) and "key " in str(e),
                      seconds=time.monotonic() - start,
                      is_jax_error=isinstance(e, jax.errors.JaxRuntimeError),
                      message=str(e)[:600])
    else:
        common.report("jit-dead-peer", False, message="no error")


def order(rank: int) -> None:
    sizes = [100, 200] if rank == 0 else [200, 100]
    start = time.monotonic()
    try:
        for size in sizes:
            herring_jax.allreduce(np.ones(size, np.float32))
    except herring_jax.HerringError as e:
        text = str(e)
        # Each rank names the reduction it was in (its first, sizes[0]) and,
        # from the peer's heartbeats, the one the peer waits in.
        common.report("order", all(f"float32[{n}]" in text for n in sizes),
                      seconds=time.monotonic() - start, message=text[:800])
    else:
        common.report("order", False, message="no error")


def absent_peer(rank: int) -> None:
    from herring_jax._src.process import jax_compat

    client = jax_compat.distributed_client()
    if rank == 1:
        # Alive (heartbeats go on) until rank 0 has its error; rank 1 leaves
        # first, since rank 0 hosts jax.distributed's coordinator.
        client.blocking_key_value_get("absent-peer/done", 120_000)
        return
    try:
        herring_jax.allreduce(np.ones(100, np.float32))
    except herring_jax.HerringError as e:
        common.report("absent-peer", "rank 1 is alive and waits in no reduction" in str(e),
                      message=str(e)[:800])
    else:
        common.report("absent-peer", False, message="no error")
    client.key_value_set("absent-peer/done", "1")
    time.sleep(2)


def failed(y):
    """`y` once its computation has failed."""
    try:
        jax.block_until_ready(y)
    except Exception:  # noqa: BLE001 - the failure is what is wanted
        return y
    raise AssertionError("the computation did not fail")


def error_types(rank: int) -> None:
    from herring_jax._src.process import jax_compat

    client = jax_compat.distributed_client()
    # XLA:CPU runs a program of under 1000 flops whose inputs are ready as it
    # is dispatched; a larger one on its own threads.
    cheap = jax.jit(lambda x: herring_jax.allreduce(x * 2))
    costly = jax.jit(lambda x, w: jnp.tanh(herring_jax.allreduce(x) @ w) @ w)
    total = jax.jit(lambda x, w: jnp.sum(herring_jax.allreduce(x) @ w))
    x, w, v = jnp.ones((64, 64)), jnp.full((64, 64), 0.01), jnp.ones(64)
    jax.block_until_ready((cheap(v), costly(x, w), total(x, w)))  # compiled, and run once
    if rank == 1:
        # Alive (heartbeats go on) until rank 0 is done; rank 1 leaves first,
        # since rank 0 hosts jax.distributed's coordinator.
        client.blocking_key_value_get("error-types/done", 120_000)
        return
    paths = {
        # The first failure: rank 1 never joins (HERRING_TIMEOUT_S).
        "block_until_ready": lambda: jax.block_until_ready(costly(x, w)),
        # From here on the communicator refuses every reduction at once.
        "method block_until_ready": lambda: costly(x, w).block_until_ready(),
        "pytree": lambda: jax.block_until_ready({"a": costly(x, w), "b": [total(x, w)]}),
        "float": lambda: float(total(x, w)),
        "numpy.asarray": lambda: np.asarray(costly(x, w)),
        "device_get": lambda: jax.device_get({"a": costly(x, w)}),
        # Each blocks too: a program that does not fail as it is dispatched
        # fails when it is awaited.
        "dispatch, first call": lambda: jax.block_until_ready(
            jax.jit(lambda u: herring_jax.allreduce(u + 1))(v)),
        "dispatch": lambda: jax.block_until_ready(cheap(v)),
        # jax operations on a result that failed: their programs fail too.
        "indexing a failed result": lambda: float(failed(costly(x, w))[0, 0]),
        "adding to a failed result": lambda: jax.block_until_ready(failed(total(x, w)) + 1),
    }
    got = {}
    for name, path in paths.items():
        for managed in (False, True):
            key = name + (" under herring_errors" if managed else "")
            try:
                with herring_jax.herring_errors() if managed else contextlib.nullcontext():
                    path()
            except Exception as e:  # noqa: BLE001 - what arrives is what is reported
                kind = ("HerringError" if isinstance(e, herring_jax.HerringError) else
                        f"{type(e).__module__}.{type(e).__qualname__}")
                # A HerringError says herring's own text, without XLA's
                # prefixes; the ValueError says XLA's status text.
                prefix = "INTERNAL: " if kind == "builtins.ValueError" else ""
                own = str(e).startswith(prefix + "herring allreduce on rank 0: ")
                got[key] = kind if own else f"{kind}: {str(e)[:300]}"
            else:
                got[key] = "no error"
    common.report("error-types", True, got=got)
    client.key_value_set("error-types/done", "1")
    time.sleep(2)


def main() -> int:
    herring_jax.initialize()
    rank = herring_jax.process_index()
    if sys.argv[1:2] == ["killed-peer"]:
        killed_peer(rank, caught=sys.argv[2:] != ["uncaught"])
        sys.stdout.flush()
        common.exit_together("killed-peer", [0, 1])
        os._exit(0)
    if sys.argv[1:] == ["leader-fails-first"]:
        leader_fails_first(rank)  # raises on every rank
    if sys.argv[1:] == ["dead-peer"]:
        dead_peer(rank)
        sys.stdout.flush()
        os._exit(0)
    if sys.argv[1:2] == ["jit-dead-peer"]:
        jit_dead_peer(rank, sys.argv[2])
        sys.stdout.flush()
        os._exit(0)
    if sys.argv[1:] in (["order"], ["absent-peer"], ["error-types"]):
        {"order": order, "absent-peer": absent_peer,
         "error-types": error_types}[sys.argv[1]](rank)
        sys.stdout.flush()
        os._exit(0)
    if sys.argv[1:2] == ["slow-peer"]:
        slow_peer(rank, float(sys.argv[2]))
        return 0
    codec_mismatch = sys.argv[1:2] == ["codec-mismatch"]
    if codec_mismatch:
        # Equal shapes, rank 0 compressing with bf16: other executables too.
        x, codec = np.ones(1000, np.float32), "bf16" if rank == 0 else "none"
    else:
        x, codec = np.ones(1000 + rank * 24, np.float32), "none"  # rank 1: 24 more elements
    start = time.monotonic()
    try:
        herring_jax.allreduce(x, codec=codec)
    except herring_jax.HerringError as e:
        common.report("mismatch", True, seconds=time.monotonic() - start, message=str(e)[:3000])
    else:
        common.report("mismatch", False, message="no error")
    # The communicator refuses further reductions with the original reason.
    try:
        herring_jax.allreduce(np.ones(4, np.float32))
    except herring_jax.HerringError as e:
        common.report("after-failure", "earlier failure" in str(e), message=str(e)[:300])
    else:
        common.report("after-failure", False, message="no error")
    sys.stdout.flush()
    os._exit(0)  # skip jax.distributed's shutdown barrier: the job is broken


if __name__ == "__main__":
    sys.exit(main())
