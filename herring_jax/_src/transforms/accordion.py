"""accordion: adaptive gradient compression (Agarwal et al., "Adaptive
Gradient Communication via Critical Learning Regime Identification",
MLSys 2021) over two of herring_jax's reducing transformations.

Training is sensitive to compression in its critical regimes: the first
steps, and the steps after a learning-rate change. Accordion finds them
from the gradient: every `interval` steps it compares the norm of the
gradient accumulated over the interval, n_now, with the last interval's,
n_prev, and uses the light compression for the next interval where

  |n_prev - n_now| / n_prev >= eta       (eta = 0.5 in the paper)

and the heavy one elsewhere. The first two intervals are light (the first
one has nothing to compare with).

How every process takes the same branch. The accumulated gradient is the
sum of the update's results, which are the reduced gradients (the same on
every process); its norm is then reduced once more (a maximum over the
workers, 4 bytes per interval), so that the decision is made from the same
bits everywhere even where processes compile the step into differently
tuned executables (XLA:CUDA autotunes per process) whose norms could
differ in the last bit. The decision, the counters and the last norm live
in the optax state, so a checkpoint resumes the same schedule.

Why a lax.cond is safe here. Only the chosen branch's reductions run. The
engine names a reduction by its call site (the slot, fixed at lowering in
program order, which is the same on every process), the run (program
identity: the executable and its launch; launch identity: the instruction
and the launches before it) and how often it ran in that run: a branch's
reductions that a launch skips are skipped by every process in that
launch, since the branch is chosen from state that is the same everywhere,
so no process waits for a reduction its peers never issue, and the next
launch names them alike again (tests/workers/accordion_worker.py switches
at every step to check it). The cost: the branch's reductions start once
all of its operands exist, so allreduce_gradients' buckets no longer
start during the backward pass (a cond takes all its operands at once).
Computing both branches and selecting a result would send both
compressions' bytes every step, and one reduction whose codec is chosen at
run time does not exist: a codec is an attribute of the compiled call.

Error feedback at a switch. The paper keeps the error-feedback memory
across switches. Here the two branches keep their own states, and at a
switch the residual of every float32 leaf that both branches keep one for
moves from the branch left to the branch entered (added to it, and zeroed
in the branch left), so that what one compression missed is sent by the
other: one memory, as if a single compressor changed its setting. A leaf
that only the branch left keeps a residual for keeps it there until that
branch runs again (never lost, never sent twice). One case waits too: topk
keeps a residual for every leaf it would sparsify with one worker, and with
more workers it may average such a leaf exactly, passing its residual
through unused; a residual moved there waits for the next switch back.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from herring_jax._src.collectives.allreduce import allreduce
from herring_jax._src.transforms.optax_transform import (AllReduceGradientsState,
                                                         CompressedGradientsState)
from herring_jax._src.transforms.powersgd import PowerSGDState
from herring_jax._src.collectives.psum import pmax
from herring_jax._src.transforms.topk import TopKState

# The states of the transformations accordion chooses between; those with a
# `residual` keep error feedback in it (one array per leaf: the leaf's shape
# where it is kept, () elsewhere).
_REDUCING_STATES = (AllReduceGradientsState, CompressedGradientsState, PowerSGDState, TopKState)
_REDUCING_NAMES = ("herring_jax.allreduce_gradients(...) (with any compression), "
                   "herring_jax.powersgd(...) or herring_jax.topk(...)")


class AccordionState(NamedTuple):
    """accordion's state (checkpointable like any optimizer state).

    Attributes:
      light: the light transformation's state.
      heavy: the heavy transformation's state.
      use_light: bool, the branch of the next update (True: light).
      step: int32, the updates so far.
      light_steps: int32, the updates that used the light transformation.
      heavy_steps: int32, the updates that used the heavy one.
      norm: float32, the norm of the gradient accumulated over the last
        full interval (reduced: the same on every worker); 0 before the
        first interval ends.
      accumulated: the sum of this interval's reduced gradients (float32
        per floating leaf, () for the others).
    """

    light: Any
    heavy: Any
    use_light: Any
    step: Any
    light_steps: Any
    heavy_steps: Any
    norm: Any
    accumulated: Any


def _check_transformation(tx, which: str) -> None:
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"herring_jax.accordion: {which} must be one of herring_jax's reducing "
                        f"transformations, {_REDUCING_NAMES}; got {type(tx).__name__}")


def _check_state(state, which: str) -> None:
    if not isinstance(state, _REDUCING_STATES):
        raise TypeError(
            f"herring_jax.accordion: {which}'s state is a {type(state).__name__}, so {which} "
            f"is not one of herring_jax's reducing transformations, {_REDUCING_NAMES}. "
            f"accordion chooses how the gradients are averaged across workers: pass the "
            "reducing transformation itself (not a chain), and put the optimizer after "
            "accordion: optax.chain(herring_jax.accordion(light, heavy, interval=...), "
            "optax.adamw(1e-3))")


def light_next(prev, now, eta) -> Any:
    """The decision at the end of an interval, float32 scalars (jax or
    numpy): light where there is no previous norm (0) or the relative change
    is at least eta; a norm that is not finite also chooses light (the
    comparison with NaN is false), since training that produced it is in
    trouble rather than in a calm regime."""
    xp = jnp if isinstance(prev, jax.Array) or isinstance(now, jax.Array) else np
    prev, now = xp.float32(prev), xp.float32(now)
    safe = xp.where(prev == 0, xp.float32(1), prev)
    change = xp.abs(prev - now) / safe
    return (prev == 0) | ~(change < xp.float32(eta))


def accordion(light: optax.GradientTransformation, heavy: optax.GradientTransformation, *,
              interval: int, eta: float = 0.5, axis_name=None
              ) -> optax.GradientTransformationExtraArgs:
    """Switches between a light and a heavy gradient compression (Accordion).

    Use it first in an ``optax.chain``, in place of the reducing
    transformation: every `interval` updates it compares the norm of the
    gradient accumulated over the interval with the previous interval's and
    reduces the next interval's gradients with `light` where the relative
    change is at least `eta` (the critical regimes: the first steps, after
    a learning-rate change), with `heavy` elsewhere. The first two intervals
    are light. Every worker takes the same branch (the norm is of the
    reduced gradient, and reduced once more), and only that branch's
    reductions run. Error feedback is one memory: at a switch the residual
    of each leaf that both keep one for moves to the branch entered.

    Args:
      light: the light compression, one of herring_jax's reducing
        transformations: ``allreduce_gradients(...)``, ``powersgd(...)`` or
        ``topk(...)``, e.g. ``powersgd(4)``, ``allreduce_gradients(
        compression="bf16")`` or ``topk(0.1)``.
      heavy: the heavy compression, e.g. ``powersgd(1)``,
        ``allreduce_gradients(compression="int8")`` or ``topk(0.01)``.
        Both must reduce over the same workers as `axis_name`.
      interval: the updates between two decisions (the paper decides every
        epoch or every few epochs), at least 1.
      eta: the threshold of the relative change of the norm, > 0 (0.5 in the
        paper: a change of half the last norm or more is critical).
      axis_name: the workers, as for the transformations: None for the
        processes, or the mesh axis name (or tuple) they reduce over inside
        ``jax.shard_map`` (``check_vma=False``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an
      ``AccordionState``: ``use_light``, ``light_steps``, ``heavy_steps``
      and ``norm`` show the schedule (``optax.tree_utils.tree_get(opt_state,
      "light_steps")`` finds them in a chain's state), and a checkpoint of it
      resumes the same schedule. Extra arguments of the update (``weight=``)
      go to both transformations.

    Examples:
      >>> tx = optax.chain(
      ...     herring_jax.accordion(herring_jax.powersgd(4), herring_jax.powersgd(1),
      ...                           interval=100),
      ...     optax.adamw(1e-3))
      >>> opt_state = tx.init(params)                                 # doctest: +SKIP
      >>> updates, opt_state = tx.update(grads, opt_state, params)    # doctest: +SKIP
      >>> int(optax.tree_utils.tree_get(opt_state, "light_steps"))   # doctest: +SKIP
    """
    _check_transformation(light, "light")
    _check_transformation(heavy, "heavy")
    if isinstance(interval, bool) or not isinstance(interval, (int, np.integer)) or interval < 1:
        raise ValueError(f"herring_jax.accordion: interval must be a whole number of updates, "
                         f"at least 1; got {interval!r}")
    if not isinstance(eta, (int, float, np.floating)) or not (math.isfinite(eta) and eta > 0):
        raise ValueError(f"herring_jax.accordion: eta must be a finite number > 0 (the paper "
                         f"uses 0.5: a change of the norm by half or more is critical); "
                         f"got {eta!r}")
    interval = int(interval)
    eta = float(eta)

    def floating(x) -> bool:
        return bool(jnp.issubdtype(x.dtype, jnp.floating))

    def zero_accumulator(tree):
        return jax.tree_util.tree_map(
            lambda x: jnp.zeros(np.shape(x) if floating(x) else (), jnp.float32), tree)

    def init_fn(params):
        light_state, heavy_state = light.init(params), heavy.init(params)
        _check_state(light_state, "light")
        _check_state(heavy_state, "heavy")
        return AccordionState(light_state, heavy_state, jnp.ones((), jnp.bool_),
                              jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
                              jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32),
                              zero_accumulator(params))

    def workers_max(x):
        if axis_name is None:
            return allreduce(x, op="max")
        return pmax(x, axis_name)

    def norm(tree):
        squares = [jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(tree)]
        return jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32)))

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, AccordionState):
            raise TypeError("herring_jax.accordion: the state is a "
                            f"{type(state).__name__}, not an AccordionState: make it with "
                            "this transformation's init(params)")

        def run_light(g, ls, hs):
            out, ls = light.update(g, ls, params, **extra_args)
            return out, ls, hs

        def run_heavy(g, ls, hs):
            out, hs = heavy.update(g, hs, params, **extra_args)
            return out, ls, hs

        # Every worker holds the same use_light (state that only reduced
        # values change), so all issue the same branch's reductions.
        out, ls, hs = jax.lax.cond(state.use_light, run_light, run_heavy,
                                   updates, state.light, state.heavy)
        accumulated = jax.tree_util.tree_map(
            lambda a, u: a + u.astype(jnp.float32) if floating(u) else a,
            state.accumulated, out)
        step = state.step + 1
        light_steps = state.light_steps + state.use_light.astype(jnp.int32)
        heavy_steps = state.heavy_steps + (~state.use_light).astype(jnp.int32)

        def decide(accumulated, ls, hs):
            now = workers_max(norm(accumulated))
            use_light = light_next(state.norm, now, eta)
            ls, hs = _hand_over(ls, hs, state.use_light, use_light, out)
            return use_light, now, zero_accumulator(accumulated), ls, hs

        def keep(accumulated, ls, hs):
            return state.use_light, state.norm, accumulated, ls, hs

        # The step count is the same on every worker: all decide together.
        use_light, last_norm, accumulated, ls, hs = jax.lax.cond(
            step % interval == 0, decide, keep, accumulated, ls, hs)
        return out, AccordionState(ls, hs, use_light, step, light_steps, heavy_steps,
                                   last_norm, accumulated)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _keeps_residual(state, leaf) -> bool:
    """Whether `state`'s residual entry for a gradient leaf is error
    feedback: it has the leaf's shape. A () entry is a placeholder (the leaf
    is reduced exactly there), except for a float32 scalar leaf under
    allreduce_gradients, which keeps a () residual for it (powersgd and
    topk never compress a scalar)."""
    return np.shape(leaf) != () or isinstance(state, CompressedGradientsState)


def _hand_over(light_state, heavy_state, was_light, use_light, grads):
    """Moves error feedback's residuals to the branch entered at a switch
    (nothing moves without one): per float32 leaf of `grads` that both
    states keep a residual for, the sum goes to the branch entered and zeros
    stay in the branch left."""
    lr = getattr(light_state, "residual", None)
    hr = getattr(heavy_state, "residual", None)
    if lr is None or hr is None:
        return light_state, heavy_state
    g_leaves, treedef = jax.tree_util.tree_flatten(grads)
    l_leaves = treedef.flatten_up_to(lr)
    h_leaves = treedef.flatten_up_to(hr)
    to_heavy = was_light & ~use_light
    to_light = ~was_light & use_light
    new_l, new_h = [], []
    for g, a, b in zip(g_leaves, l_leaves, h_leaves):
        kept = (a.shape == b.shape == np.shape(g) and a.dtype == b.dtype == jnp.float32
                and _keeps_residual(light_state, g) and _keeps_residual(heavy_state, g))
        if not kept:
            new_l.append(a)
            new_h.append(b)
            continue
        both = a + b
        new_l.append(jnp.where(to_heavy, jnp.zeros_like(a), jnp.where(to_light, both, a)))
        new_h.append(jnp.where(to_light, jnp.zeros_like(b), jnp.where(to_heavy, both, b)))
    return (light_state._replace(residual=jax.tree_util.tree_unflatten(treedef, new_l)),
            heavy_state._replace(residual=jax.tree_util.tree_unflatten(treedef, new_h)))


def schedule_np(norms, eta: float) -> list[bool]:
    """numpy model of the rule: the branch of each interval (True: light)
    from the norms measured at the end of each interval before it (float32
    scalars, as accordion computes them): interval 0 is light, and interval
    k+1 follows light_next(norm[k-1] or 0, norm[k])."""
    branches, prev = [True], np.float32(0)
    for now in norms:
        branches.append(bool(light_next(prev, np.float32(now), eta)))
        prev = np.float32(now)
    return branches
