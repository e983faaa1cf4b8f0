"""Checkpoints of sharded_optimizer's state: each process writes one file of
its own holding its chunks, so that no two processes ever write one file (on
NFS and object-store mounts they would overwrite each other's bytes); the
checkpoint is read without herring_jax (numpy.load) and restored on any
number of processes.

Layout of a checkpoint directory:
  manifest.json   the format, the processes that saved it, each file with
                  its bytes, and every leaf: the state leaf's path, whether
                  it is chunked (a parameter's, then the parameter's index)
                  or the same on every process, its shape, dtype and member;
  shards/<r>.npz  process r's file (uncompressed .npz): member state_<k>
                  holds its elements [r*c, min((r+1)*c, size)) of state leaf
                  k flattened, c = ceil(size / processes) (empty where that
                  range is); params_<i> the same of parameter i; residual_<k>
                  its own error feedback, whole. Process 0's file also holds
                  the state leaves the same on every process, whole.
Every process writes its file under a name of its own, flushes it to the
device and renames it into place; once every process has reported its file
written, rank 0 writes the manifest and moves the directory into place: a
directory with a manifest is complete. Each step's outcome (done, or an
error) reaches every process (checkpoint_agreement), so a failure anywhere
raises on every process at once and leaves no manifest.
Version 1's layout (one whole .npy per leaf, written by every process through
memory maps) is still restored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from herring_jax._src.checkpoints import checkpoint_files as files
from herring_jax._src.process import runtime
from herring_jax._src.checkpoints.checkpoint_agreement import Agreement
from herring_jax._src.transforms.chunks import chunk_range, chunk_shape

FORMAT = "herring_jax sharded optimizer state, version 2"
FORMAT_V1 = "herring_jax sharded optimizer state, version 1"
# A chunk length no parameter has, marking which state leaves are chunks of
# which parameter (see _chunked_leaves).
_MARK = 1_000_003


def _fully(tx) -> bool:
    from herring_jax._src.transforms.fully_sharded import FullySharded
    return isinstance(tx, FullySharded)


def _inner(tx) -> Any:
    if _fully(tx):
        return tx.inner
    inner = getattr(getattr(tx, "init", None), "sharded_inner", None)
    if inner is None:
        raise TypeError("save_sharded / restore_sharded take the transformation made by "
                        "herring_jax.sharded_optimizer, or herring_jax.fully_sharded's object")
    return inner


def _whole_params(tx, state, params):
    """The parameters as shapes and dtypes (fully_sharded: from its state,
    which holds their chunks; else `params`, whole)."""
    if _fully(tx):
        return [jax.ShapeDtypeStruct(s, d) for s, d in state.shapes]
    if params is None:
        raise ValueError("save_sharded needs the parameters (their shapes say how the state's "
                         "chunks unpad)")
    return jax.tree_util.tree_leaves(params)


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


def _members(tx, state, params, rank: int, n: int) -> tuple[list, list, dict]:
    """The manifest's state and params entries, and this process's members:
    for each, a function that copies its values to the host, in file dtype."""
    inner = _inner(tx)
    p_leaves = _whole_params(tx, state, params)
    if np.ndim(state.shard) != 0:
        raise ValueError("save_sharded saves the state of sharded_optimizer over processes; "
                         "inside shard_map the state is a sharded global array: save it with "
                         "orbax")
    if int(state.shard) != rank:
        raise ValueError(f"this state is process {int(state.shard)}'s chunks, not process "
                         f"{rank}'s: pass each process its own state")
    shapes_tree = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(state.chunks if _fully(tx) else params), p_leaves)
    owners = _chunked_leaves(inner, shapes_tree)
    s_paths = jax.tree_util.tree_flatten_with_path(state.inner)[0]
    if len(s_paths) != len(owners):
        raise ValueError("this state does not come from this transformation and these "
                         "parameters")

    def part(x, lo: int, hi: int):
        return lambda: files.as_file_dtype(np.ravel(np.asarray(x))[lo:hi])

    entries, members = [], {}
    for k, ((path, leaf), owner) in enumerate(zip(s_paths, owners)):
        shape = np.shape(p_leaves[owner]) if owner is not None else np.shape(leaf)
        entries.append({"path": jax.tree_util.keystr(path), "param": owner,
                        "chunked": owner is not None, "shape": list(shape),
                        "dtype": np.dtype(leaf.dtype).name, "member": f"state_{k}"})
        if owner is None:
            if rank == 0:
                members[f"state_{k}"] = lambda x=leaf: files.as_file_dtype(np.asarray(x))
            continue
        if np.shape(leaf) != chunk_shape(shape, n):
            raise ValueError(f"state leaf {entries[-1]['path']} has shape {np.shape(leaf)}, "
                             f"not {chunk_shape(shape, n)}: it was made on another number of "
                             "processes or for other parameters")
        lo, hi = chunk_range(int(np.prod(shape, dtype=np.int64)), n, rank)
        # The chunk's first hi - lo elements: the rest is padding.
        members[f"state_{k}"] = part(leaf, 0, hi - lo)
    p_entries = []
    chunks = jax.tree_util.tree_leaves(state.chunks) if _fully(tx) else None
    # Each parameter's name, so that a restore of another model can say which.
    p_paths = [f"params{jax.tree_util.keystr(path)}" for path, _ in
               jax.tree_util.tree_flatten_with_path(state.chunks if _fully(tx) else params)[0]]
    for i, p in enumerate(p_leaves):
        p_entries.append({"path": p_paths[i], "chunked": True, "shape": list(np.shape(p)),
                          "dtype": np.dtype(p.dtype).name, "member": f"params_{i}"})
        lo, hi = chunk_range(int(np.prod(np.shape(p), dtype=np.int64)), n, rank)
        # fully_sharded holds the chunk only (padded past hi - lo).
        members[f"params_{i}"] = part(chunks[i], 0, hi - lo) if chunks else part(p, lo, hi)
    for k, r in enumerate(jax.tree_util.tree_leaves(state.residual)):
        members[f"residual_{k}"] = lambda x=r: files.as_file_dtype(np.asarray(x))
    return entries, p_entries, members


_PARTIAL = re.compile(r".+\.partial-\d+")


def _remove_stale_partials(directory: str) -> None:
    """Removes what saves killed midway left beside `directory`: the
    `<name>.partial-<generation>` directories of save_sharded's layout (with
    shards/ inside). Saves are collective and each returns only once its
    directory is in place, so any such directory is of a save that never
    completed."""
    parent = os.path.dirname(os.path.abspath(directory))
    try:
        names = os.listdir(parent)
    except OSError:
        return  # no parent yet: nothing left there
    for name in names:
        path = os.path.join(parent, name)
        if _PARTIAL.fullmatch(name) and os.path.isdir(os.path.join(path, "shards")):
            shutil.rmtree(path, ignore_errors=True)


def save_sharded(directory: str, tx, state, params=None) -> None:
    """Writes sharded_optimizer's `state` (and `params`) to `directory`, each
    process its chunks into a file of its own. Call it on every process, with
    the transformation that made the state, outside jit.

    A failure on any process (the directory exists, a disk is full, ...)
    raises the same error on every process at once, naming the rank, and
    leaves no manifest. What a failed or killed save left
    (``<directory>.partial-<generation>``) is removed by the next save into
    the same parent directory.

    Args:
      directory: where the checkpoint goes (on a file system every process
        sees); it must not exist yet.
      tx: the ``herring_jax.sharded_optimizer(...)`` transformation, or the
        ``herring_jax.fully_sharded(...)`` object.
      state: its state (``ShardedOptimizerState``, as returned by update; or
        ``FullyShardedState``).
      params: the parameters (the same on every process); each process writes
        its chunk of each. None for fully_sharded (its state holds them).

    Examples:
      >>> herring_jax.save_sharded("ckpt/100", tx, opt_state, params)  # doctest: +SKIP
    """
    st = runtime.state()
    rank, n = st.rank, st.size
    agree = Agreement(f"save_sharded({directory!r})")
    tmp = directory + f".partial-{st.generation}"
    if rank == 0:
        _remove_stale_partials(directory)
    shard = os.path.join("shards", f"{rank}.npz")
    # Whatever fails on a process, every process raises (agree.step) at once.
    error = None
    try:
        entries, p_entries, members = _members(tx, state, params, rank, n)
        if rank == 0:
            if os.path.exists(directory):
                raise FileExistsError(f"{directory} exists; checkpoints are never overwritten")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "shards"))
    except Exception as e:
        error = e
    agree.step("prepare", error)
    size = 0
    try:
        size = files.write_shard(os.path.join(tmp, shard), members)
    except Exception as e:
        error = e
    sizes = agree.step("write", error, str(size))
    if rank == 0:
        try:
            files.write_json(os.path.join(tmp, "manifest.json"), {
                "format": FORMAT, "processes": n,
                "files": [{"name": f"shards/{r}.npz", "bytes": int(b)}
                          for r, b in enumerate(sizes)],
                "state": entries, "params": p_entries,
                "residuals": len(jax.tree_util.tree_leaves(state.residual))})
            os.rename(tmp, directory)
            files.sync_directory(os.path.dirname(os.path.abspath(directory)))
        except Exception as e:
            error = e
    # Every process returns once the checkpoint is in place.
    agree.step("commit", error)
    agree.completed()


def _open(directory: str):
    path = os.path.join(directory, "manifest.json")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} does not exist: {directory} is not a checkpoint of save_sharded, or an "
            "incomplete one (the manifest is written last, once every process has written "
            "its file)") from None
    fmt = manifest.get("format")
    if fmt == FORMAT:
        return manifest, files.Shards(directory, manifest)
    if fmt == FORMAT_V1:
        return manifest, files.Version1(directory, manifest)
    raise ValueError(f"{directory} is not a herring_jax sharded checkpoint this version reads: "
                     f"its format is {fmt!r}; this one reads {FORMAT!r} and {FORMAT_V1!r}")


def restore_sharded(directory: str, tx, params, *, cast: bool = False):
    """Reads a checkpoint of save_sharded onto this job, whatever its number
    of processes: returns (state, params) with this process's chunks.

    Each process reads, of the state, only the chunks that overlap its own,
    and every parameter whole (every process holds the parameters whole).

    Args:
      directory: a checkpoint written by save_sharded.
      tx: the ``herring_jax.sharded_optimizer(...)`` transformation of this
        job (the same inner transformation as the one saved), or the
        ``herring_jax.fully_sharded(...)`` object.
      params: parameters of the right structure, shapes and dtypes (their
        values are not used: the saved ones are returned;
        ``jax.ShapeDtypeStruct`` leaves do for fully_sharded).
      cast: False (default): a saved leaf (parameter, state or residual)
        whose dtype differs from the one `params` makes is refused, naming
        the leaf and both dtypes. True: the saved values are converted to
        this job's dtypes (``numpy.astype``), e.g. to resume a float32 run
        in bfloat16.

    Returns:
      sharded_optimizer: ``(state, params)``. fully_sharded: its
      ``FullyShardedState``, with this process's chunks of the parameters
      and of the state (read from whichever files hold them).
    """
    st = runtime.state()
    rank, n = st.rank, st.size
    manifest, reader = _open(directory)
    try:
        return _restore(directory, tx, params, manifest, reader, rank, n, cast)
    finally:
        reader.close()


def _check_dtype(directory: str, name: str, saved: np.dtype, wanted: np.dtype,
                 cast: bool) -> None:
    if saved != wanted and not cast:
        raise ValueError(
            f"{directory} holds {name} as {saved.name}, but the parameters given to "
            f"restore_sharded make it {wanted.name}: pass parameters of the saved dtypes, or "
            "cast=True to convert the saved values to these")


def _residual(values: np.ndarray, like, cast: bool) -> np.ndarray:
    """A saved error feedback residual in this job's dtype: the file holds
    16-bit floats' bits (checkpoint_files.file_dtype), so a residual saved
    in the dtype wanted is its bits viewed back. One saved in another dtype
    (the parameters' dtypes changed, cast=True) starts from zero, as on
    another number of processes: the file does not say which 16-bit float
    its bits are."""
    wanted = np.dtype(like.dtype)
    if values.dtype == files.file_dtype(wanted.name) and values.shape == tuple(like.shape):
        return values.view(wanted)
    if not cast:
        raise ValueError(f"an error feedback residual was saved as {values.dtype.name}"
                         f"{list(values.shape)}, this job's is {wanted.name}"
                         f"{list(like.shape)}: pass parameters of the saved dtypes, or "
                         "cast=True (the residual then starts from zero)")
    return np.zeros(like.shape, wanted)


def _other_parameters(directory: str, saved: list, p_leaves: list, p_names: list) -> str:
    """The refusal of a checkpoint of another model: the first parameter
    whose shape differs, by name, with both shapes (checkpoints written
    before names were saved are named by this job's parameters)."""
    def shape(s):
        return "(" + ", ".join(str(d) for d in s) + ("," if len(s) == 1 else "") + ")"

    differ = [i for i in range(max(len(saved), len(p_leaves)))
              if i >= len(saved) or i >= len(p_leaves)
              or list(np.shape(p_leaves[i])) != saved[i]["shape"]]
    i = differ[0]
    if i >= len(p_leaves):
        what = (f"it holds {saved[i].get('path', f'parameter leaf {i}')} "
                f"{shape(saved[i]['shape'])}, which this job's parameters lack")
    elif i >= len(saved):
        what = f"{p_names[i]} {shape(np.shape(p_leaves[i]))} was not saved"
    else:
        name = saved[i].get("path", p_names[i])
        what = (f"{p_names[i]} has shape {shape(np.shape(p_leaves[i]))} here, "
                f"{shape(saved[i]['shape'])} in the checkpoint"
                + (f" (saved as {name})" if name != p_names[i] else ""))
    counts = ("" if len(saved) == len(p_leaves) else
              f"; it holds {len(saved)} parameters, this job {len(p_leaves)}")
    more = f"; {len(differ) - 1} more differ" if len(differ) > 1 else ""
    return (f"{directory} holds the parameters of another model: {what}{counts}{more}. "
            "Restore it with the model (parameter shapes) it was saved with")


def _restore(directory, tx, params, manifest, reader, rank: int, n: int, cast: bool):
    inner = _inner(tx)
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    p_leaves = [jax.ShapeDtypeStruct(tuple(np.shape(p)) if not hasattr(p, "shape") else
                                     tuple(p.shape), p.dtype) for p in p_leaves]
    p_names = [f"params{jax.tree_util.keystr(path)}"
               for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if len(manifest["params"]) != len(p_leaves) or any(
            list(np.shape(p)) != m["shape"] for p, m in zip(p_leaves, manifest["params"])):
        raise ValueError(_other_parameters(directory, manifest["params"], p_leaves, p_names))
    fully = _fully(tx)
    template = jax.eval_shape(tx.init, params)
    like, s_def = jax.tree_util.tree_flatten(template.inner)
    owners = _chunked_leaves(inner, params)
    entries = manifest["state"]
    if len(entries) != len(like) or any(e["param"] != o for e, o in zip(entries, owners)):
        raise ValueError(f"{directory} holds the state of another inner transformation")

    def typed(flat, entry, like_dtype, name):
        saved = np.dtype(jnp.dtype(entry["dtype"]))
        _check_dtype(directory, name, saved, np.dtype(like_dtype), cast)
        return flat.view(saved).astype(np.dtype(like_dtype), copy=False)

    # Every leaf's dtype before any file is read: a refusal costs no reading.
    for name, m, p in zip(p_names, manifest["params"], p_leaves):
        _check_dtype(directory, name, np.dtype(jnp.dtype(m["dtype"])), np.dtype(p.dtype), cast)
    leaves = []
    for e, t in zip(entries, like):
        name = f"state{e['path']}"
        if not e["chunked"]:
            leaves.append(jnp.asarray(typed(reader.whole(e), e, t.dtype, name).reshape(t.shape)))
            continue
        lo, hi = chunk_range(int(np.prod(e["shape"], dtype=np.int64)), n, rank)
        chunk = np.zeros(int(np.prod(t.shape, dtype=np.int64)), np.dtype(t.dtype))
        chunk[:hi - lo] = typed(reader.range(e, lo, hi), e, t.dtype, name)
        leaves.append(jnp.asarray(chunk.reshape(t.shape)))
    if fully:
        # This process's chunk of each parameter, from whichever files hold it.
        restored = []
        for p, m, name in zip(p_leaves, manifest["params"], p_names):
            lo, hi = chunk_range(int(np.prod(np.shape(p), dtype=np.int64)), n, rank)
            shape = chunk_shape(np.shape(p), n)
            chunk = np.zeros(int(np.prod(shape, dtype=np.int64)), np.dtype(p.dtype))
            chunk[:hi - lo] = typed(reader.range(m, lo, hi), m, p.dtype, name)
            restored.append(jnp.asarray(chunk.reshape(shape)))
    else:
        restored = [jnp.asarray(typed(reader.whole(m), m, p.dtype, name).reshape(np.shape(p)))
                    for p, m, name in zip(p_leaves, manifest["params"], p_names)]
    residual = jax.tree_util.tree_map(lambda t: jnp.zeros(t.shape, t.dtype), template.residual)
    if manifest["residuals"] and manifest["processes"] == n:
        r_leaves, r_def = jax.tree_util.tree_flatten(residual)
        residual = jax.tree_util.tree_unflatten(r_def, [
            jnp.asarray(_residual(reader.residual(rank, k), t, cast))
            for k, t in enumerate(r_leaves)])
    inner_state = jax.tree_util.tree_unflatten(s_def, leaves)
    shard = jnp.asarray(rank, jnp.int32)
    if fully:
        return dataclasses.replace(template, chunks=jax.tree_util.tree_unflatten(p_def, restored),
                                   inner=inner_state, shard=shard, residual=residual)
    state = template._replace(inner=inner_state, shard=shard, residual=residual)
    return state, jax.tree_util.tree_unflatten(p_def, restored)
