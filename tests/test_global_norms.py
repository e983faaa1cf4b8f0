"""sharded_optimizer's global norms: optax's tree norms sum over the workers
only on the thread tracing the inner transformation. A metrics thread that
calls optax.tree.norm meanwhile gets optax's own norm, with no herring
reduction in its program (one would pair with no other process and hang).
In one process: the programs are traced, never run across processes."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from herring_jax._src.transforms import sharded_checks

# The test names every alias optax still serves, the deprecated ones too.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

AXIS = "w"  # the metrics thread's own named axis, as inside its shard_map
TREE = {"a": jnp.arange(3.0), "b": jnp.full((2, 2), 2.0)}
WANT = float(np.sqrt(np.sum(np.arange(3.0) ** 2) + 4 * 4.0))


def _herring_primitives(jaxpr) -> list[str]:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("herring"):
            found.append(eqn.primitive.name)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found += _herring_primitives(inner)
    return found


def _trace(norm):
    return jax.make_jaxpr(norm, axis_env=[(AXIS, 2)])(TREE).jaxpr


def _norms_of_every_kind():
    """Each name global_norms redirects, as a function of TREE."""
    kinds = {"optax.tree.norm": lambda t: optax.tree.norm(t),
             "optax.tree_utils.tree_norm": lambda t: optax.tree_utils.tree_norm(t),
             "optax.tree_utils.tree_l2_norm": lambda t: optax.tree_utils.tree_l2_norm(t)}
    if hasattr(optax, "global_norm"):
        kinds["optax.global_norm"] = lambda t: optax.global_norm(t)
    return kinds


def test_another_thread_gets_optax_norm_while_one_traces_inside_global_norms():
    inside, leave = threading.Event(), threading.Event()
    seen = {}

    def tracer():
        # As sharded_optimizer around inner.update over the named axis.
        with sharded_checks.global_norms(sharded_checks.global_sum(AXIS)):
            seen["tracer"] = {k: _herring_primitives(_trace(f))
                              for k, f in _norms_of_every_kind().items()}
            inside.set()
            leave.wait(60)

    thread = threading.Thread(target=tracer)
    thread.start()
    try:
        assert inside.wait(60), "the tracing thread never entered global_norms"
        for name, norm in _norms_of_every_kind().items():
            # Checked first: before the fix this program held herring's
            # reduction (and running it would fail for want of the axis).
            assert _herring_primitives(_trace(norm)) == [], name
            assert float(jax.jit(norm)(TREE)) == np.float32(WANT), name
            assert float(norm(TREE)) == np.float32(WANT), name
    finally:
        leave.set()
        thread.join(60)
    # The setting is one that matters: the tracing thread did get herring's sums.
    # (herring's psum is one equation holding its reduction: composite.py.)
    for name, prims in seen["tracer"].items():
        assert prims == ["herring_psum", "herring_allreduce"], (name, prims)


def test_nested_global_norms_take_the_innermost_and_leave_optax_as_it_was():
    before = {k: getattr(m, k) for m, k in [(optax.tree, "norm"),
                                            (optax.tree_utils, "tree_norm"),
                                            (optax.tree_utils, "tree_l2_norm")]}
    with sharded_checks.global_norms(lambda x: x * 4.0):
        assert np.isclose(float(optax.tree.norm(TREE)), 2 * WANT)
        with sharded_checks.global_norms(lambda x: x * 9.0):
            assert np.isclose(float(optax.tree.norm(TREE)), 3 * WANT)
            assert np.isclose(float(optax.tree.norm(TREE, squared=True)), 9 * WANT ** 2)
        assert np.isclose(float(optax.tree.norm(TREE)), 2 * WANT)
    assert np.isclose(float(optax.tree.norm(TREE)), WANT)
    after = {k: getattr(m, k) for m, k in [(optax.tree, "norm"),
                                           (optax.tree_utils, "tree_norm"),
                                           (optax.tree_utils, "tree_l2_norm")]}
    assert after == before
