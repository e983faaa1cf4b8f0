"""Checkpoints of sharded_optimizer's state: each process writes only its
chunks, into one plain .npy file per leaf holding the whole, unpadded array,
so that a checkpoint is read without herring_jax (numpy.load) and restored
on any number of processes.

Layout of a checkpoint directory:
  manifest.json   what every file holds: the state leaf's path, whether it is
                  a parameter's chunks (then the parameter's index and shape)
                  or the same on every process, its dtype and shape;
  state/<k>.npy   state leaf k, whole (a parameter's shape for chunked ones);
  params/<i>.npy  parameter i, whole, if params were saved;
  residual/<rank>/<k>.npy  error feedback, each process's own (only restored
                  onto as many processes as saved it; zeros otherwise).
Rank 0 creates every file; after a barrier each process writes its chunk
ranges into them (memory-mapped, so each writes about 1/N of the bytes);
after a second barrier rank 0 writes the manifest and moves the directory
into place: a directory with a manifest is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from herring_jax._src import jax_compat
from herring_jax._src import knobs
from herring_jax._src import runtime

FORMAT = "herring_jax sharded optimizer state, version 1"
# A chunk length no parameter has, marking which state leaves are chunks of
# which parameter (see _chunked_leaves).
_MARK = 1_000_003


def _inner(tx) -> Any:
    inner = getattr(tx.init, "sharded_inner", None)
    if inner is None:
        raise TypeError("save_sharded / restore_sharded take the transformation made by "
                        "herring_jax.sharded_optimizer")
    return inner


def _chunked_leaves(inner, params) -> list[int | None]:
    """For each leaf of inner.init's state (flattened), the index of the
    parameter whose chunks it holds, or None for a leaf that is the same on
    every process. Found by shapes: the state is built (abstractly) on chunks
    whose lengths are unique per parameter."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    fake = [jax.ShapeDtypeStruct((1,) * (np.ndim(p) - 1) + (_MARK + i,), p.dtype)
            for i, p in enumerate(leaves)]
    state = jax.eval_shape(inner.init, jax.tree_util.tree_unflatten(treedef, fake))
    owners = []
    for s in jax.tree_util.tree_leaves(state):
        last = s.shape[-1] if s.shape else -1
        owners.append(last - _MARK if _MARK <= last < _MARK + len(leaves) else None)
    return owners


def _barrier(name: str) -> None:
    st = runtime.state()
    jax_compat.distributed_client().wait_at_barrier(
        f"herring_jax/{st.generation}/checkpoint/{name}",
        int(knobs.get("HERRING_TIMEOUT_S") * 1000))


def _range(size: int, n: int, r: int) -> tuple[int, int]:
    c = -(-size // n) if size else 0
    return min(size, r * c), min(size, (r + 1) * c)


def save_sharded(directory: str, tx, state, params=None) -> None:
    """Writes sharded_optimizer's `state` (and `params`, if given) to
    `directory`, each process its own chunks. Call it on every process, with
    the transformation that made the state, outside jit.

    Args:
      directory: where the checkpoint goes (on a file system every process
        sees); it must not exist yet.
      tx: the ``herring_jax.sharded_optimizer(...)`` transformation.
      state: its state (``ShardedOptimizerState``), as returned by update.
      params: the parameters (the same on every process); each process writes
        its chunk of each.

    Examples:
      >>> herring_jax.save_sharded("ckpt/100", tx, opt_state, params)  # doctest: +SKIP
    """
    st = runtime.state()
    rank, n = st.rank, st.size
    if params is None:
        raise ValueError("save_sharded needs the parameters (their shapes say how the state's "
                         "chunks unpad)")
    inner = _inner(tx)
    p_leaves = jax.tree_util.tree_leaves(params)
    owners = _chunked_leaves(inner, params)
    s_paths = jax.tree_util.tree_flatten_with_path(state.inner)[0]
    if len(s_paths) != len(owners):
        raise ValueError("this state does not come from this transformation and these "
                         "parameters")
    tmp = directory + f".partial-{st.generation}"
    entries = []
    for (path, leaf), owner in zip(s_paths, owners):
        shape = np.shape(p_leaves[owner]) if owner is not None else np.shape(leaf)
        entries.append({"path": jax.tree_util.keystr(path), "param": owner,
                        "shape": list(shape), "dtype": np.dtype(leaf.dtype).name})
    if rank == 0:
        if os.path.exists(directory):
            raise FileExistsError(f"{directory} exists; checkpoints are never overwritten")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "state"))
        os.makedirs(os.path.join(tmp, "params"))
        for k, e in enumerate(entries):
            np.lib.format.open_memmap(os.path.join(tmp, "state", f"{k}.npy"), mode="w+",
                                      dtype=_file_dtype(e["dtype"]), shape=tuple(e["shape"]))
        for i, p in enumerate(p_leaves):
            np.lib.format.open_memmap(os.path.join(tmp, "params", f"{i}.npy"), mode="w+",
                                      dtype=_file_dtype(np.dtype(p.dtype).name),
                                      shape=np.shape(p))
    _barrier(f"{directory}/created")
    for k, ((_, leaf), e) in enumerate(zip(s_paths, entries)):
        target = os.path.join(tmp, "state", f"{k}.npy")
        if e["param"] is None:
            if rank == 0:
                _write(target, 0, np.ravel(np.asarray(leaf)))
            continue
        size = int(np.prod(e["shape"], dtype=np.int64))
        lo, hi = _range(size, n, rank)
        _write(target, lo, np.ravel(np.asarray(leaf))[:hi - lo])
    for i, p in enumerate(p_leaves):
        lo, hi = _range(int(np.size(p)), n, rank)
        _write(os.path.join(tmp, "params", f"{i}.npy"), lo, np.ravel(np.asarray(p))[lo:hi])
    residual = jax.tree_util.tree_leaves(state.residual)
    if residual:
        mine = os.path.join(tmp, "residual", str(rank))
        os.makedirs(mine, exist_ok=True)
        for k, r in enumerate(residual):
            np.save(os.path.join(mine, f"{k}.npy"), np.asarray(r))
    _barrier(f"{directory}/written")
    if rank == 0:
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump({"format": FORMAT, "processes": n, "state": entries,
                       "params": [{"shape": list(np.shape(p)), "dtype": np.dtype(p.dtype).name}
                                  for p in p_leaves],
                       "residuals": len(residual)}, f, indent=1)
        os.replace(tmp, directory)
    _barrier(f"{directory}/done")


def restore_sharded(directory: str, tx, params):
    """Reads a checkpoint of save_sharded onto this job, whatever its number
    of processes: returns (state, params) with this process's chunks.

    Args:
      directory: a checkpoint written by save_sharded.
      tx: the ``herring_jax.sharded_optimizer(...)`` transformation of this
        job (the same inner transformation as the one saved).
      params: parameters of the right structure, shapes and dtypes (their
        values are not used: the saved ones are returned).
    """
    st = runtime.state()
    rank, n = st.rank, st.size
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{directory} is not a herring_jax sharded checkpoint")
    inner = _inner(tx)
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    if len(manifest["params"]) != len(p_leaves) or any(
            list(np.shape(p)) != m["shape"] for p, m in zip(p_leaves, manifest["params"])):
        raise ValueError(f"{directory} holds other parameters (shapes) than these")
    template = jax.eval_shape(tx.init, params)
    like, s_def = jax.tree_util.tree_flatten(template.inner)
    owners = _chunked_leaves(inner, params)
    entries = manifest["state"]
    if len(entries) != len(like) or any(e["param"] != o for e, o in zip(entries, owners)):
        raise ValueError(f"{directory} holds the state of another inner transformation")
    leaves = []
    for k, (e, t) in enumerate(zip(entries, like)):
        data = _read(os.path.join(directory, "state", f"{k}.npy"), e["dtype"])
        if e["param"] is None:
            leaves.append(jnp.asarray(np.array(data), t.dtype))
            continue
        size = data.size
        lo, hi = _range(size, n, rank)
        chunk = np.zeros(int(np.prod(t.shape)), data.dtype)
        chunk[:hi - lo] = np.ravel(data)[lo:hi]
        leaves.append(jnp.asarray(chunk.reshape(t.shape), t.dtype))
    restored_params = [jnp.asarray(np.array(_read(
        os.path.join(directory, "params", f"{i}.npy"), m["dtype"])), p.dtype)
        for i, (p, m) in enumerate(zip(p_leaves, manifest["params"]))]
    residual = jax.tree_util.tree_map(lambda t: jnp.zeros(t.shape, t.dtype), template.residual)
    if manifest["residuals"] and manifest["processes"] == n:
        r_leaves, r_def = jax.tree_util.tree_flatten(residual)
        residual = jax.tree_util.tree_unflatten(r_def, [
            jnp.asarray(np.load(os.path.join(directory, "residual", str(rank), f"{k}.npy")))
            for k in range(len(r_leaves))])
    state = template._replace(inner=jax.tree_util.tree_unflatten(s_def, leaves),
                              shard=jnp.asarray(rank, jnp.int32), residual=residual)
    return state, jax.tree_util.tree_unflatten(p_def, restored_params)


def _file_dtype(name: str) -> np.dtype:
    """What a .npy holds for `name`: the dtype itself, or for the dtypes numpy
    cannot name in a file (bfloat16, ...) unsigned integers of their width,
    the bits (the manifest says which dtype to view them as)."""
    dtype = np.dtype(jnp.dtype(name))
    if dtype.kind in "biufc":
        return dtype
    return np.dtype(f"u{dtype.itemsize}")


def _read(path: str, name: str) -> np.ndarray:
    """The .npy at `path` (memory-mapped), viewed as dtype `name`."""
    data = np.load(path, mmap_mode="r")
    dtype = np.dtype(jnp.dtype(name))
    return data if data.dtype == dtype else data.view(dtype)


def _write(path: str, at: int, values: np.ndarray) -> None:
    """values into the flattened array of the .npy at `path`, from element `at`."""
    if values.size == 0:
        return
    out = np.load(path, mmap_mode="r+")
    flat = out.reshape(-1)
    if values.dtype != flat.dtype:
        values = values.view(flat.dtype)  # bfloat16 and friends: their bits
    flat[at:at + values.size] = values
    out.flush()
    del out
