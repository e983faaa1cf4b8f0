"""What sharded_optimizer needs of its inner transformation: global norms
inside it, and the check that it treats its leaves element by element.

The inner transformation sees only this worker's chunks. Element-wise
transformations cannot tell; two kinds of transformation can:
- those that sum over every leaf, through ``optax.tree.norm`` (and
  ``optax.global_norm``), as ``clip_by_global_norm`` does. While the inner
  transformation is traced, those functions add the workers' partial sums
  (global_norms) on the tracing thread, so they see the whole gradient;
  other threads keep optax's own;
- those that look at a whole leaf (trust ratios, factored moments, matrix
  steps) or test every gradient at once inline (``apply_if_finite``). They
  would silently be wrong; check_elementwise finds them at init by running
  the inner transformation on small stand-in parameters both whole and in
  chunks (the workers simulated by jax.vmap, their sums by its psum) and
  comparing.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as _tree_utils

from herring_jax._src.transforms import verdicts
from herring_jax._src.transforms.chunks import chunk_shape, chunk_size

# The largest size of any axis of a stand-in parameter: small enough for a
# quick check, large enough that shape-dependent choices (adafactor factors
# axes of 128 or more) are taken as on the real parameters.
_STAND_IN_AXIS = 160
_PROBE_AXIS = "herring_jax_sharded_probe"
# Relative difference below which chunked and whole updates agree (they may
# differ in the last bits only through a global norm's order of sums).
_TOLERANCE = 1e-5


def _norm_with(total: Callable[[Any], Any]):
    """optax.tree.norm, its sums taken over every worker by `total`."""

    def norm(tree, ord=None, squared: bool = False):  # noqa: A002 - optax's name
        leaves = jax.tree_util.tree_leaves(tree)
        # In float32 whatever the leaves' dtype (optax sums 16-bit squares in
        # their own dtype).
        leaves = [jnp.asarray(x, jnp.float32) for x in leaves]
        if ord in (None, 2):
            local = sum((jnp.sum(x * x) for x in leaves), jnp.zeros((), jnp.float32))
            sq = total(jnp.asarray(local, jnp.float32))
            return sq if squared else jnp.sqrt(sq)
        if ord == 1:
            local = sum((jnp.sum(jnp.abs(x)) for x in leaves), jnp.zeros((), jnp.float32))
            ret = total(jnp.asarray(local, jnp.float32))
        elif ord in (jnp.inf, "inf", "infinity"):
            raise NotImplementedError(
                "sharded_optimizer: optax.tree.norm(..., ord=inf) inside the inner "
                "transformation needs a maximum over the workers, which is not supported; "
                "use ord=2 or run it outside sharded_optimizer")
        else:
            raise ValueError(f"Unsupported ord: {ord}")
        return ret * ret if squared else ret

    return norm


def _norm_targets():
    """The functions global_norms redirects: (module, name, optax's function)."""
    targets = [(optax.tree, "norm"), (_tree_utils, "tree_norm"), (_tree_utils, "tree_l2_norm"),
               (optax, "global_norm")]
    # Reading a deprecated name warns the user of something they did not write.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return [(mod, name, getattr(mod, name)) for mod, name in targets if hasattr(mod, name)]


# The norms in force on this thread, innermost last. Only the thread tracing
# the inner transformation may see herring's sums: another thread (a metrics
# thread computing optax.tree.norm meanwhile) would trace a reduction that no
# other process joins, and hang.
_this_thread = threading.local()
# Guards _installed and the module attributes.
_patch_lock = threading.Lock()
# (module, name) -> (optax's function, the dispatcher put in its place,
# whether the module held it itself), for as long as any thread is inside
# global_norms.
_installed: dict = {}
_users = 0


def _dispatcher(original, name: str):
    """In place of optax's `original`: herring's norm on a thread inside
    global_norms, optax's own everywhere else."""

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        stack = getattr(_this_thread, "norms", None)
        if not stack:
            return original(*args, **kwargs)
        if name == "global_norm":
            return stack[-1](args[0] if args else kwargs["updates"], 2)
        return stack[-1](*args, **kwargs)

    return dispatch


def _install():
    global _users
    with _patch_lock:
        if not _users:
            for mod, name, original in _norm_targets():
                dispatch = _dispatcher(original, name)
                # A deprecated name that optax serves through its module's
                # __getattr__ (with its warning) goes back to being served so.
                _installed[(mod, name)] = (original, dispatch, name in vars(mod))
                setattr(mod, name, dispatch)
        _users += 1


def _uninstall():
    global _users
    with _patch_lock:
        _users -= 1
        if _users:
            return
        for (mod, name), (original, dispatch, own) in _installed.items():
            # Someone who replaced it since keeps theirs.
            if vars(mod).get(name) is not dispatch:
                continue
            if own:
                setattr(mod, name, original)
            else:
                delattr(mod, name)
        _installed.clear()


@contextlib.contextmanager
def global_norms(total: Callable[[Any], Any]):
    """Within, on this thread only: optax's tree norms (and global_norm) sum
    over every worker through `total`. Nested uses take the innermost."""
    norm = _norm_with(total)
    stack = getattr(_this_thread, "norms", None)
    if stack is None:
        stack = _this_thread.norms = []
    _install()
    stack.append(norm)
    try:
        yield
    finally:
        stack.pop()
        _uninstall()


def stand_in(params, seed: int):
    """Small parameters shaped like `params` (every axis at most
    _STAND_IN_AXIS), filled with seeded normal values."""
    rng = np.random.default_rng(seed)
    # numpy arrays: jnp's conversion would compile a program per leaf shape.
    return jax.tree_util.tree_map(
        lambda p: np.asarray(rng.normal(size=tuple(min(d, _STAND_IN_AXIS)
                                                   for d in np.shape(p))) * 3.0,
                             dtype=p.dtype), params)


def _chunks(tree, n: int):
    """Every worker's chunk of every leaf, stacked: leaves of (n, *chunk_shape)
    (numpy, outside the checked program: jnp's ops per leaf and worker took
    a third of the check's time to trace)."""
    def stacked(x):
        flat = np.ravel(x)
        c = chunk_size(flat.size, n)
        rows = np.pad(flat, (0, n * c - flat.size)).reshape(n, c)
        return rows.reshape((n,) + chunk_shape(np.shape(x), n))
    return jax.tree_util.tree_map(stacked, tree)


def _differs(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape:
        return np.inf
    nan = np.isnan(a) | np.isnan(b)
    if np.any(np.isnan(a) != np.isnan(b)):
        return np.inf
    d = np.abs(a - b)[~nan]
    if not d.size:
        return 0.0
    # Relative to the leaf's largest update: an element near zero may move
    # by the last bits of the others (a global norm's order of sums).
    return float(d.max() / max(float(np.max(np.abs(b[~nan]))), 1e-30))


# The checks that passed, by the inner transformation (the object itself, held
# here so that its id is never another's), the stand-ins' shapes and dtypes
# and the number of workers. The check is most of init's time (clip + adamw
# on a 4-layer MLP, 2 processes sharing 2 busy cores: 8-35 s of 13-38 s);
# an init traced again (inside another jitted function, by a restore, after
# a restart in the same process) needs no second verdict: 1.4-3.8 s there
# against 9.8-16.8 s.
_passed: dict = {}
_passed_lock = threading.Lock()
_PASSED_MAX = 64


def _verdict_key(inner, params, n: int):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return (id(inner), treedef, n, tuple(
        (tuple(min(d, _STAND_IN_AXIS) for d in np.shape(p)), np.dtype(p.dtype).name)
        for p in leaves))


def check_elementwise(inner: optax.GradientTransformation, params, n: int) -> None:
    """Raises ValueError if `inner` on n workers' chunks updates otherwise
    than on whole leaves (stand-in parameters shaped like `params`; two
    steps, then a step with one non-finite gradient). A check that passed
    for this inner transformation, these shapes and dtypes and n is not run
    again. In a job of several processes process 0 runs it and the others
    take its verdict (verdicts.shared)."""
    key = _verdict_key(inner, params, n)
    with _passed_lock:
        if _passed.get(key) is inner:
            return
    verdicts.shared(_shape_digest(params, n), lambda: _run_check(inner, params, n))
    with _passed_lock:
        if len(_passed) >= _PASSED_MAX:
            _passed.pop(next(iter(_passed)))
        _passed[key] = inner


def _shape_digest(params, n: int) -> str:
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return repr((str(treedef), n, [(np.shape(p), np.dtype(p.dtype).name) for p in leaves]))


def _run_check(inner, params, n: int) -> None:
    if isinstance(jnp.zeros(()), jax.core.Tracer):
        # Called while tracing (init under jax.jit): the check's programs
        # must run now, on the concrete stand-ins, not join the caller's.
        with jax.ensure_compile_time_eval():
            _check(inner, params, n)
    else:
        # Not without need: inside it, every operation of the inner
        # transformation on constants (its zeros, its hyper-parameters) runs
        # and compiles on its own while the two programs are traced, which
        # took as long again as compiling the programs.
        _check(inner, params, n)


def _check(inner, params, n: int) -> None:
    p = stand_in(params, 0)
    grads = [stand_in(params, 1), stand_in(params, 2)]
    leaves, treedef = jax.tree_util.tree_flatten(grads[0])
    if leaves:
        # One NaN in the first element of the largest leaf: a transformation
        # that tests every gradient at once must then decide alike on every
        # worker, which it cannot on chunks.
        big = max(range(len(leaves)), key=lambda i: np.size(leaves[i]))
        bad = list(leaves)
        bad[big] = bad[big].copy()
        bad[big].reshape(-1)[0] = np.nan
        grads.append(jax.tree_util.tree_unflatten(treedef, bad))

    def run_steps(params, grads_list):
        """Two steps, then one with the non-finite gradient from a fresh state;
        the updates of each."""
        state = inner.init(params)
        params_now, outs = params, []
        for k, g in enumerate(grads_list):
            s = state if k < 2 else inner.init(params)
            u, s = inner.update(g, s, params_now if k < 2 else params)
            if k < 2:
                state, params_now = s, optax.apply_updates(params_now, u)
            outs.append(u)
        return outs

    def chunk_steps(p_c, g_cs):
        with global_norms(lambda x: jax.lax.psum(x, _PROBE_AXIS)):
            return run_steps(p_c, g_cs)

    def both(p, grads_list, p_chunks, grads_chunks):
        with global_norms(lambda x: x):
            want = run_steps(p, grads_list)
        return want, jax.vmap(chunk_steps, axis_name=_PROBE_AXIS)(p_chunks, grads_chunks)

    # Both sides as one compiled program, compiled without XLA's backend
    # optimisations: op by op (as the compile-time evaluation around this
    # would run it) every operation is compiled apart (the first init of
    # sharded_optimizer(clip + adamw) on a 4-layer MLP took 4.4-5.4 s that way
    # against 1.8-2.4 s compiled), and the check runs once, on small arrays,
    # so compiling is nearly all its cost: one program at optimisation level
    # 0 took 2.4 s where the two optimised ones took 5.0 s (train_lm's model,
    # 4 layers, adamw). The comparison has a tolerance: contracted
    # multiply-adds cannot change its verdict.
    args = (p, grads, _chunks(p, n), [_chunks(g, n) for g in grads])
    compiled = jax.jit(both).lower(*args).compile(
        compiler_options={"xla_backend_optimization_level": 0})
    want, outs = compiled(*args)
    # Each worker's rows joined back into whole leaves.
    got = [jax.tree_util.tree_map(
        lambda rows, x: np.ravel(np.asarray(rows))[:np.size(x)].reshape(np.shape(x)), out, p)
        for out in outs]
    steps = ["step 1", "step 2", "a step with one non-finite gradient"]
    for k, (w, g) in enumerate(zip(want, got)):
        paths = jax.tree_util.tree_flatten_with_path(w)[0]
        for (path, wv), gv in zip(paths, jax.tree_util.tree_leaves(g)):
            diff = _differs(gv, wv)
            if diff > _TOLERANCE:
                raise ValueError(
                    "herring_jax.sharded_optimizer: the inner transformation does not treat "
                    "its parameters element by element: on chunks of them (as each of "
                    f"{n} workers holds them) it updates {jax.tree_util.keystr(path)} "
                    f"otherwise than on whole parameters ({steps[k]}, relative difference "
                    f"{diff:.3g}). Transformations that look at a whole parameter (LAMB's "
                    "and LARS's trust ratios, adafactor's factored moments, Muon, "
                    "clip_by_block_rms) or test every gradient at once (apply_if_finite) "
                    "cannot run on chunks: use optax.chain(herring_jax.allreduce_gradients(), "
                    "inner) for them, or keep them outside sharded_optimizer where they "
                    "apply to whole updates. (check_inner=False skips this check.)")


def global_sum(axis_name):
    """The sum over the workers of a scalar, in a fixed order."""
    from herring_jax._src.collectives.allreduce import allreduce
    from herring_jax._src.collectives.psum import psum

    def total(x):
        return allreduce(x) if axis_name is None else psum(x, axis_name)
    return total
