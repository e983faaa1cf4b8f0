"""local_sgd, slowmo, diloco: optimizers that communicate every H steps
instead of every step, as optax gradient transformations over herring.

Each worker (process, or device of a mesh axis) runs `inner` on its own
gradients, with no communication, for `every` steps. At the last step of each
period the workers average their pseudo-gradients, the parameters of the last
sync minus their own now, through one herring reduction (the bucketed path of
``allreduce_gradients``, with its codecs and error feedback), and `outer`
steps the synced parameters with that average as its gradient. Every worker
then holds the new synced parameters and starts the next period from them.

  Local SGD (Stich, ICLR 2019; Lin et al., ICLR 2020): outer ``sgd(1.0)``,
    the synced parameters become the workers' average.
  SlowMo (Wang et al., ICLR 2020): slow momentum on the average,
    u = beta u + (x0 - x_avg) / gamma, x0 -= alpha gamma u.
  DiLoCo (Douillard et al., 2023): inner AdamW, outer Nesterov SGD
    (learning rate 0.7, momentum 0.9).

The names are the ones JAX and PyTorch users meet for these methods:
PyTorch's ``PostLocalSGDOptimizer`` and torchft's ``LocalSGD`` / ``DiLoCo``,
fairseq's ``slowmo``, MaxText's ``diloco`` trainer.

Evaluation order (what the bitwise tests model): at a sync step with
parameters p, inner update u and synced parameters s, the pseudo-gradient is
(s - p) - u, not s - (p + u): with H = 1 it is then -u exactly, and the
update handed back is (s - p) + o for the outer update o, so that
``optax.apply_updates`` gives s + o exactly where p = s.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from herring_jax._src.transforms import streaming
from herring_jax._src.transforms.optax_transform import allreduce_gradients, step_weight
from herring_jax._src.collectives.psum import check_gradients


class LocalSGDState(NamedTuple):
    """The state of ``local_sgd``, ``slowmo`` and ``diloco``.

    Attributes:
      count: inner steps taken (int32); a sync ends every ``every``-th.
      synced: the parameters of the last sync (at first: the parameters given
        to ``init``), the same on every worker.
      inner: the inner transformation's state, this worker's own.
      outer: the outer transformation's state, the same on every worker;
        with ``fragments=F > 1`` or a delay, a tuple of F states, fragment
        f's made by ``outer.init`` of the list of its leaves (each fragment
        takes one outer step per period, so a momentum or a step count is
        its own).
      reduce: the reduction's state: with a lossy ``compression`` and error
        feedback, what this worker's pseudo-gradients lost on the wire so far
        (``CompressedGradientsState``); else ``AllReduceGradientsState()``.
      pending: with a delay, ``streaming.Pending``: the tokens of each
        fragment's reduction in flight (uint8, this process's own: they name
        reductions of its engine) and a copy of what the last fragment to
        start sent (at most one fragment's bytes), from which a run resumed
        from a checkpoint starts that reduction again; else () (no leaves).
    """

    count: Any
    synced: Any
    inner: Any
    outer: Any
    reduce: Any
    pending: Any = ()


def _check_count(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"herring_jax.local_sgd: {name} must be an int of at least {least}, "
                         f"got {value!r}")
    return int(value)


def local_sgd(inner: optax.GradientTransformation, every: int,
              outer: optax.GradientTransformation | None = None, *, axis_name=None,
              compression: str = "none", error_feedback: bool = True,
              fusion_bytes: int | None = None, first_bucket_bytes: int | None = None,
              fragments: int = 1, delay: int = 0, mixing: float = 0.5
              ) -> optax.GradientTransformation:
    """Runs `inner` locally and synchronises the workers every `every` steps.

    Use it in place of ``optax.chain(herring_jax.allreduce_gradients(), inner)``.
    Steps that do not end a period are `inner` alone on this worker's
    gradients: no bytes cross. The step that ends one (step count a multiple
    of `every`) averages the pseudo-gradients (synced parameters minus this
    worker's parameters after its inner step) across the workers and steps
    the synced parameters with `outer`; its update moves every worker to the
    new synced parameters. The choice is a ``lax.cond`` on the step count,
    which is the same on every worker, so all of them issue the reduction at
    the same steps. The update needs the parameters:
    ``tx.update(grads, state, params)`` (``nnx.Optimizer`` and Linen's
    ``TrainState.apply_gradients`` pass them).

    The workers must start from the same parameters (broadcast them first,
    as for data parallelism). `inner`'s state stays each worker's own across
    syncs (as DiLoCo keeps its inner AdamW moments).

    Args:
      inner: the optimizer of the local steps (e.g. ``optax.adamw(1e-3)``).
      every: H, the steps in a period (1: a sync every step).
      outer: the optimizer of the synced parameters, fed the averaged
        pseudo-gradient. None (default): ``optax.sgd(1.0)``, which makes the
        synced parameters the workers' average (Local SGD).
      axis_name: None: the workers are the processes. A mesh axis name (or
        tuple): the devices of that axis inside ``jax.shard_map(...,
        check_vma=False)``, each with its own parameters and state.
      compression: the wire codec of the pseudo-gradients (``"none"``,
        ``"bf16"``, ``"fp16"``, ``"int8"``; see ``allreduce_gradients``).
      error_feedback: with a lossy codec, add what the encoding of the last
        pseudo-gradients lost to the next ones, kept as allreduce_gradients
        keeps it (what the engine encoded: nothing on one host; with a
        delay, taken when the fragment arrives).
      fusion_bytes, first_bucket_bytes: as for ``allreduce_gradients``.
      fragments: F, Streaming DiLoCo's fragments (Douillard et al., 2025):
        the leaves are cut into F runs of about equal bytes
        (``streaming.fragment_leaves``) and fragment f syncs alone at the
        steps where ``count % every == f * every // F``, one reduction of
        its leaves and one outer step of them per period; the other leaves
        go on with their inner updates. 1 (default): every leaf at once, at
        the end of each period. At most `every` and at most the number of
        leaves.
      delay: D, the steps a fragment's reduction overlaps (Streaming
        DiLoCo's tau). 0 (default): the fragment's average is applied at its
        sync step. D >= 1: the pseudo-gradient is sent at the sync step and
        reduced on herring's threads while the next D steps compute; its
        outer step is applied D steps later, merged by `mixing`. Less than
        ``every // fragments``; across processes only (axis_name None) and
        on XLA:CPU. A checkpoint saved after any step resumes bitwise: the
        state keeps a copy of what the fragment in flight sent, and a
        resumed run's arrival step reduces it again. A fragment still in
        flight when training stops is not in the final parameters
        (``herring_jax.local_sgd_in_flight`` says whether one is, and
        shutdown names its ticket); a checkpoint saved then applies it
        when resumed.
      mixing: with delay >= 1, what a fragment's parameters become on
        arrival: ``mixing * local + (1 - mixing) * (synced + outer update)``,
        local being this worker's parameters then (Streaming DiLoCo's
        alpha). 0 replaces them by the new global value; 0.5 (default)
        keeps half of the local progress made meanwhile.

    Returns:
      An ``optax.GradientTransformation`` with ``LocalSGDState``.

    Examples:
      >>> tx = herring_jax.local_sgd(optax.adamw(1e-3), every=16)
      >>> opt_state = tx.init(params)                                 # doctest: +SKIP
      >>> updates, opt_state = tx.update(grads, opt_state, params)    # doctest: +SKIP
    """
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
        raise ValueError(f"herring_jax.local_sgd: every must be a positive int (the inner "
                         f"steps between syncs), got {every!r}")
    every = int(every)
    fragments = _check_count("fragments", fragments, 1)
    if fragments > every:
        raise ValueError(f"herring_jax.local_sgd: fragments={fragments} is more than every="
                         f"{every}: each fragment syncs at its own step of the period, so "
                         f"use at most {every} fragments (or a longer period)")
    delay = _check_count("delay", delay, 0)
    streaming.check_delay(delay, every, fragments, axis_name)
    if not 0 <= mixing <= 1:
        raise ValueError(f"herring_jax.local_sgd: mixing must be in [0, 1] (the share of the "
                         f"local parameters kept when a delayed fragment arrives), got "
                         f"{mixing!r}")
    outer = optax.sgd(1.0) if outer is None else outer
    reducer = allreduce_gradients(axis_name, compression=compression,
                                  error_feedback=error_feedback, fusion_bytes=fusion_bytes,
                                  first_bucket_bytes=first_bucket_bytes)

    def init_fn(params):
        # A copy: a step that donates both the parameters and the state
        # (donate_argnums) must not be handed one buffer twice.
        return LocalSGDState(count=jnp.zeros([], jnp.int32),
                             synced=jax.tree_util.tree_map(lambda p: jnp.array(p, copy=True),
                                                           params),
                             inner=inner.init(params),
                             outer=streaming.init_outer(outer, params, fragments, delay),
                             reduce=reducer.init(params),
                             pending=streaming.init_pending(params, fragments, delay))

    def sync(u, params, synced, outer_state, reduce_state):
        pseudo = jax.tree_util.tree_map(lambda s, p, v: (s - p) - v, synced, params, u)
        average, reduce_state = reducer.update(pseudo, reduce_state)
        o, outer_state = outer.update(average, outer_state, synced)
        new_synced = optax.apply_updates(synced, o)
        update = jax.tree_util.tree_map(lambda s, p, d, v: ((s - p) + d).astype(v.dtype),
                                        synced, params, o, u)
        return update, new_synced, outer_state, reduce_state

    def stay(u, params, synced, outer_state, reduce_state):
        del params
        return u, synced, outer_state, reduce_state

    def update_fn(updates, state, params=None, **extra_args):
        # A weighted mean is not built in here: refuse the weight that
        # optax.chain would otherwise hand on to be dropped.
        step_weight(None, extra_args, "local_sgd", supported=False)
        if params is None:
            raise ValueError("herring_jax.local_sgd needs the parameters: call "
                             "tx.update(grads, state, params)")
        if not isinstance(state, LocalSGDState):
            raise TypeError(f"herring_jax.local_sgd: the state is a {type(state).__name__}, "
                            "not a LocalSGDState: make it with this transformation's init")
        check_gradients(updates, axis_name, "local_sgd")
        u, inner_state = inner.update(updates, state.inner, params)
        count = state.count + 1
        if fragments > 1 or delay:
            update, synced, outer_state, reduce_state, pending = streaming.streamed_update(
                u, params, state, count, every=every, fragments=fragments, delay=delay,
                mixing=mixing, outer=outer, reducer=reducer, compression=compression)
            return update, LocalSGDState(count, synced, inner_state, outer_state, reduce_state,
                                         pending)
        args = (u, params, state.synced, state.outer, state.reduce)
        if every == 1:
            out = sync(*args)
        else:
            # The count is the same on every worker, so every worker takes
            # the same branch and the reduction pairs up.
            out = jax.lax.cond(count % every == 0, sync, stay, *args)
        update, synced, outer_state, reduce_state = out
        return update, LocalSGDState(count, synced, inner_state, outer_state, reduce_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class SlowMomentumState(NamedTuple):
    """SlowMo's slow momentum buffer u."""

    momentum: Any


def slow_momentum(learning_rate: float, momentum: float,
                  slow_learning_rate: float) -> optax.GradientTransformation:
    """SlowMo's outer step as an optax transformation: for the averaged
    pseudo-gradient d = x0 - x_avg, u = beta u + d / gamma and the update
    -alpha gamma u (gamma = `learning_rate`, beta = `momentum`, alpha =
    `slow_learning_rate`)."""
    if not learning_rate > 0:
        raise ValueError(f"herring_jax.slowmo: learning_rate is gamma, the inner optimizer's "
                         f"learning rate, which the pseudo-gradient is divided by: it must be "
                         f"positive, got {learning_rate!r}")

    def init_fn(params):
        return SlowMomentumState(jax.tree_util.tree_map(jnp.zeros_like, params))

    # d / gamma as d times 1 / gamma: XLA turns a division by a constant into
    # that multiplication under jit, and eager use must give the same bits.
    inverse = 1.0 / learning_rate

    def update_fn(updates, state, params=None):
        del params
        u = jax.tree_util.tree_map(lambda m, d: momentum * m + d * inverse,
                                   state.momentum, updates)
        step = -(slow_learning_rate * learning_rate)
        return jax.tree_util.tree_map(lambda m: step * m, u), SlowMomentumState(u)

    return optax.GradientTransformation(init_fn, update_fn)


def slowmo(inner: optax.GradientTransformation, every: int, *, learning_rate: float,
           momentum: float = 0.5, slow_learning_rate: float = 1.0,
           **kwargs) -> optax.GradientTransformation:
    """SlowMo (Wang et al., "SlowMo: Improving Communication-Efficient
    Distributed SGD with Slow Momentum", ICLR 2020) over herring.

    ``every`` steps of `inner` per worker, an exact average of the
    parameters, then the slow momentum step on the synced parameters x0:
    u = beta u + (x0 - x_avg) / gamma, x0 -= alpha gamma u. beta = 0 and
    alpha = 1 is Local SGD; it generalises BMUF.

    Args:
      inner: the base optimizer (the paper's is SGD with Nesterov momentum).
      every: tau, the base steps between syncs.
      learning_rate: gamma, the base optimizer's learning rate.
      momentum: beta, the slow momentum.
      slow_learning_rate: alpha, the slow learning rate.
      **kwargs: ``axis_name``, ``compression``, ``error_feedback``,
        ``fusion_bytes``, ``first_bucket_bytes``, ``fragments``, ``delay``,
        ``mixing`` of ``local_sgd``.

    Returns:
      An ``optax.GradientTransformation`` with ``LocalSGDState``.

    Examples:
      >>> tx = herring_jax.slowmo(optax.sgd(0.1, momentum=0.9, nesterov=True), every=12,
      ...                         learning_rate=0.1, momentum=0.6)
    """
    return local_sgd(inner, every, slow_momentum(learning_rate, momentum, slow_learning_rate),
                     **kwargs)


def diloco(inner: optax.GradientTransformation, every: int, *,
           outer_learning_rate: float = 0.7, outer_momentum: float = 0.9,
           **kwargs) -> optax.GradientTransformation:
    """DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication
    Training of Language Models", 2023) over herring.

    ``every`` inner steps per worker (AdamW in the paper, H = 500), then an
    outer Nesterov SGD step of the synced parameters on the averaged
    pseudo-gradient (synced parameters minus each worker's): ``optax.sgd(
    outer_learning_rate, momentum=outer_momentum, nesterov=True)``.

    Args:
      inner: the inner optimizer, e.g. ``optax.adamw(1e-3)``.
      every: H, the inner steps between syncs.
      outer_learning_rate, outer_momentum: the outer Nesterov SGD's (0.7 and
        0.9, the paper's).
      **kwargs: ``axis_name``, ``compression``, ``error_feedback``,
        ``fusion_bytes``, ``first_bucket_bytes``, ``fragments``, ``delay``,
        ``mixing`` of ``local_sgd``.

    Returns:
      An ``optax.GradientTransformation`` with ``LocalSGDState``.

    Examples:
      >>> tx = herring_jax.diloco(optax.adamw(1e-3), every=64, compression="int8")
    """
    outer = optax.sgd(outer_learning_rate, momentum=outer_momentum, nesterov=True)
    return local_sgd(inner, every, outer, **kwargs)
