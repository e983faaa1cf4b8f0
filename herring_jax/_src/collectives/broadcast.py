"""herring_jax.broadcast: every process gets the root process's values, as
Horovod's broadcast_parameters (ranks that initialise or restore differently
start from the same parameters).

It is a reduction in disguise, so it uses the same balanced parameter-server
path: the root contributes its values, every other process zeros (made by
the handler), and the engine sums. Floating values travel as unsigned integers of the same width,
so the sum is exact whatever the bits (-0.0, NaN payloads, subnormals): every
process gets bitwise the root's value.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from herring_jax._src.collectives import allreduce as _allreduce
from herring_jax._src.process import jax_compat
from herring_jax._src.process import knobs
from herring_jax._src.process import runtime

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _describe(x) -> str:
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}".replace(" ", "")


def _check_same_tree(names, leaves, root: int) -> None:
    """Outside jit: every process's tree must be the root's (paths, shapes,
    dtypes). A small broadcast of the description's digest comes first; a
    process whose tree differs raises ValueError naming the first leaf that
    differs (the root's description is in jax.distributed's key-value store)
    instead of waiting in a reduction of another shape until the timeout."""
    mine = json.dumps([[n, _describe(x)] for n, x in zip(names, leaves)])
    digest = hashlib.blake2b(mine.encode(), digest_size=8).digest()
    state = runtime.state()
    key = f"herring_jax/{state.generation}/broadcast/{digest.hex()}"
    client = jax_compat.distributed_client()
    if state.rank == root:
        client.key_value_set(key, mine, allow_overwrite=True)
    [theirs] = _allreduce.bind([jnp.asarray(np.frombuffer(digest, np.uint32))], op="sum",
                               axes=None, root=root)
    theirs = np.asarray(theirs).tobytes()
    if theirs == digest:
        return
    timeout_ms = int(knobs.get("HERRING_INIT_TIMEOUT_S") * 1000)
    root_tree = dict(json.loads(client.blocking_key_value_get(
        f"herring_jax/{state.generation}/broadcast/{theirs.hex()}", timeout_ms)))
    own = dict(json.loads(mine))
    differ = [f"{n} is {own[n]} here and {root_tree[n]} on rank {root}"
              for n in own if n in root_tree and own[n] != root_tree[n]]
    differ += [f"{n} is only here" for n in own if n not in root_tree]
    differ += [f"{n} is only on rank {root}" for n in root_tree if n not in own]
    shown = "; ".join(differ[:3]) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
    raise ValueError(
        f"herring_jax.broadcast: rank {state.rank}'s tree differs from the root's (rank "
        f"{root}): {shown}. Every process must pass the same structure, shapes and dtypes "
        "(the same model configuration).")


def _parts(x):
    """The leaf as integer arrays whose sum over processes is exact."""
    if x.dtype == jnp.bool_:
        return [x.astype(jnp.uint8)]
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _parts(jnp.real(x)) + _parts(jnp.imag(x))
    if jnp.issubdtype(x.dtype, jnp.floating):
        return [jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize])]
    return [x]


def _join(x, parts):
    """Inverse of _parts for a leaf like `x`."""
    if x.dtype == jnp.bool_:
        return parts[0].astype(jnp.bool_)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        real_dtype = jnp.real(x).dtype
        re = jax.lax.bitcast_convert_type(parts[0], real_dtype)
        im = jax.lax.bitcast_convert_type(parts[1], real_dtype)
        return jax.lax.complex(re, im)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(parts[0], x.dtype)
    return parts[0]


def broadcast(tree: Any, root: int = 0) -> Any:
    """Returns the root process's value of every leaf, on every process.

    Every process must call it with the same tree structure, shapes and dtypes.
    Works inside and outside ``jax.jit`` on process-local values (one device
    per process in the computation). Every dtype herring_jax reduces, and
    bool; results are bitwise the root's. Not differentiable (use it on
    parameters and state, not inside a loss).

    Args:
      tree: a pytree of arrays.
      root: the rank whose values everyone receives.

    Returns:
      The pytree, with the root's values on every process.

    Raises:
      ValueError: root is not a rank of this job, or the computation spans
        several devices of one process.

    Examples:
      >>> params = model.init(jax.random.key(herring_jax.process_index()), x)  # doctest: +SKIP
      >>> params = herring_jax.broadcast(params, root=0)   # doctest: +SKIP
    """
    runtime.state()  # the helpful message before initialize(), before any JAX call
    n = runtime.process_count()
    if not isinstance(root, (int, np.integer)) or not 0 <= root < n:
        raise ValueError(f"root must be a rank of this job, 0 <= root < {n}; got {root!r}")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    names = _allreduce.leaf_names(tree)
    leaves = [jnp.asarray(x) for x in leaves]
    for name, x in zip(names, leaves):
        if x.dtype != jnp.bool_:
            _allreduce.prepare_leaf(name, x)  # the dtype check and its message
    if not any(isinstance(x, jax.core.Tracer) for x in leaves):
        _check_same_tree(names, leaves, int(root))
    # Every process binds the same program; the handler makes the zeros off
    # the root (a per-process constant here would compile a different program
    # per process, and XLA's run id, which matches reductions, would differ).
    parts, counts = [], []
    for x in leaves:
        p = _parts(jax.lax.stop_gradient(x))
        parts += p
        counts.append(len(p))
    summed = _allreduce.bind(parts, op="sum", axes=None, root=int(root))
    outs, at = [], 0
    for x, k in zip(leaves, counts):
        outs.append(_join(x, summed[at:at + k]))
        at += k
    return jax.tree_util.tree_unflatten(treedef, outs)
