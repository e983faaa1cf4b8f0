"""The training examples' checkpoints (train_lm.py --checkpoint-dir), after
whole steps, and the resume from the latest one:

- Checkpoints: orbax, for allreduce_gradients and --sharded-optimizer (whose
  state orbax saves as global arrays of one row per device, cut into fewer
  devices' chunks by restore_fewer);
- FullyShardedCheckpoints: herring_jax.save_sharded / restore_sharded, for
  --fully-sharded, whose state is each process's own chunks (not global
  arrays): each process writes only its chunks, and a checkpoint restores
  onto any number of processes.

Both keep the two latest checkpoints, one directory per step
(<dir>/<steps done>), and save on SIGTERM (herring_jax.catch_preemption) at a
step every process agrees on.
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import herring_jax


class _Saves:
    """What both kinds of checkpoints share: `directory`, and maybe_save."""

    directory: str

    def maybe_save(self, done: int, last: bool, params, opt_state) -> None:
        raise NotImplementedError

    def stop_for_preemption(self, done: int, params, opt_state) -> bool:
        """After `done` steps: whether the job stops here because a process got
        SIGTERM (the same answer on every process), saving first if this step
        was not saved yet. A collective: every process calls it after each step."""
        if not herring_jax.preemption_requested():
            return False
        self.maybe_save(done, True, params, opt_state)
        print(f"process {jax.process_index()}: preempted, saved the checkpoint after step "
              f"{done} in {self.directory}; exiting", flush=True)
        return True


def _names(path) -> tuple:
    """A pytree path as names, the same for a tree and orbax's metadata of it
    (which turns NamedTuples into dicts)."""
    return tuple(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


class Checkpoints(_Saves):
    """orbax checkpoints of (params, opt_state) after whole steps.

    A run started with a --checkpoint-dir that holds checkpoints resumes after
    the latest one. Batches depend only on (seed, rank, step) and herring's
    sums are bitwise reproducible, so a killed and resumed run ends with the
    same parameters as one that was never interrupted.
    """

    def __init__(self, args):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.every = args.checkpoint_every
        if self.every < 1:
            raise SystemExit(f"--checkpoint-every must be at least 1, got {self.every}")
        self.sharded = bool(getattr(args, "sharded_optimizer", False))
        self.local_sgd = bool(getattr(args, "local_steps", 0))
        # With the handler named, a fresh manager can read a checkpoint's
        # shapes (item_metadata) before it saves or restores anything.
        self.manager = ocp.CheckpointManager(
            os.path.abspath(args.checkpoint_dir), item_handlers=ocp.StandardCheckpointHandler(),
            options=ocp.CheckpointManagerOptions(max_to_keep=2,
                                                 enable_async_checkpointing=False))
        self.directory = str(self.manager.directory)

    def restore(self, params, opt_state):
        """Returns (params, opt_state, steps done): the latest checkpoint, or the inputs.

        --sharded-optimizer's state saved by more devices than this job has (a
        restart on fewer processes, herring-jax launch --min-processes) is cut
        into this job's chunks (restore_fewer); --local-steps' workers beyond
        this job's devices are left out (restore_fewer_workers)."""
        done = self.manager.latest_step()
        if done is None:
            return params, opt_state, 0
        target = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            {"params": params, "opt_state": opt_state})
        saved = {_names(path): tuple(m.shape) for path, m in
                 jax.tree_util.tree_leaves_with_path(self.manager.item_metadata(done))}
        if all(saved.get(_names(path)) == t.shape
               for path, t in jax.tree_util.tree_leaves_with_path(target)):
            state = self.manager.restore(done, args=self._ocp.args.StandardRestore(target))
        else:
            state = self.restore_fewer(done, target, saved)
        return state["params"], state["opt_state"], done

    def restore_fewer(self, done: int, target, saved: dict):
        """--sharded-optimizer's state saved by N devices, onto this job's M < N.

        Each state leaf is a global array of N rows, row d device d's: a chunk
        (the flattened elements [d*c, (d+1)*c) of a parameter's state, c =
        ceil(size / N), zero-padded at the end), or a value of its own (a step
        count, the same in every row; the chunk's index, d). Flattened, their
        first M rows of c' = ceil(size / M) elements are this job's rows: what
        lies beyond is padding, or rows of the devices that are gone. Error
        feedback residuals start from zero (as restore_sharded's do)."""
        here = jax.tree_util.tree_leaves_with_path(target)
        devices = len(jax.devices())
        if self.local_sgd:
            return self.restore_fewer_workers(done, target, saved)
        rows = {saved.get(_names(p), (None,))[0] for p, _ in here if _names(p)[0] == "opt_state"}
        params_same = all(saved.get(_names(p)) == t.shape for p, t in here
                          if _names(p)[0] == "params")
        saved_devices = max(rows, key=lambda r: r or 0)
        if not (self.sharded and params_same and len(rows) == 1 and saved_devices > devices):
            self.refuse(done, here, saved, "--sharded-optimizer's state")
        replicated = NamedSharding(jax.tree_util.tree_leaves(target)[0].sharding.mesh, P())
        read = jax.tree_util.tree_map_with_path(
            lambda p, t: jax.ShapeDtypeStruct(saved[_names(p)], t.dtype, sharding=replicated),
            target)
        state = self.manager.restore(done, args=self._ocp.args.StandardRestore(read))

        def cut(path, was, t):
            if _names(path)[0] == "params":
                return was
            size = int(np.prod(t.shape, dtype=np.int64))
            flat = np.ravel(np.asarray(was.addressable_shards[0].data))[:size]
            if "residual" in _names(path):
                flat = np.zeros(0, flat.dtype)
            rows = np.pad(flat, (0, size - flat.size)).reshape(t.shape)
            return jax.make_array_from_callback(t.shape, t.sharding, lambda index: rows[index])

        if jax.process_index() == 0:
            print(f"the checkpoint after step {done} holds --sharded-optimizer's state of "
                  f"{saved_devices} devices: cut into chunks of {devices}",
                  flush=True)
        return jax.tree_util.tree_map_with_path(cut, state, target)

    def refuse(self, done: int, here, saved: dict, what: str):
        changed = next(p for p, t in here if saved.get(_names(p)) != t.shape)
        raise SystemExit(
            f"the checkpoint after step {done} in {self.directory} holds "
            f"{jax.tree_util.keystr(changed)} of shape {saved.get(_names(changed))}, this "
            f"job's differs: it is not this model's, or {what} of fewer devices than this "
            f"job's {len(jax.devices())} (a restart can leave processes out, never add them)")

    def restore_fewer_workers(self, done: int, target, saved: dict):
        """--local-steps' parameters and state saved by N workers (devices),
        onto this job's M < N.

        Every leaf has a leading axis of one row per worker: its own
        parameters, inner state and residual, and the synced parameters and
        outer state, which are the same in every row. Workers 0..M-1 go on
        with rows 0..M-1; the other workers' local progress since the last
        sync is dropped (the next sync averages M pseudo-gradients). With a
        --delay fragment in flight, each remaining worker starts it again
        from its own copy, so its average is over the M workers."""
        here = jax.tree_util.tree_leaves_with_path(target)
        devices = len(jax.devices())
        rows = {saved.get(_names(p), (None,))[0] for p, _ in here}
        if not (len(rows) == 1 and next(iter(rows)) > devices and all(
                saved.get(_names(p), ())[1:] == t.shape[1:] for p, t in here)):
            self.refuse(done, here, saved, "--local-steps' state")
        saved_devices = next(iter(rows))
        replicated = NamedSharding(jax.tree_util.tree_leaves(target)[0].sharding.mesh, P())
        read = jax.tree_util.tree_map_with_path(
            lambda p, t: jax.ShapeDtypeStruct(saved[_names(p)], t.dtype, sharding=replicated),
            target)
        state = self.manager.restore(done, args=self._ocp.args.StandardRestore(read))

        def first_rows(was, t):
            rows = np.asarray(was.addressable_shards[0].data)[:t.shape[0]]
            return jax.make_array_from_callback(t.shape, t.sharding, lambda index: rows[index])

        if jax.process_index() == 0:
            print(f"the checkpoint after step {done} holds --local-steps' state of "
                  f"{saved_devices} workers: workers 0..{devices - 1} go on from their own, "
                  f"the others' steps since their last sync are dropped", flush=True)
        return jax.tree_util.tree_map(first_rows, state, target)

    def maybe_save(self, done: int, last: bool, params, opt_state) -> None:
        if (done % self.every == 0 or last) and self.manager.latest_step() != done:
            state = {"params": params, "opt_state": opt_state}
            self.manager.save(done, args=self._ocp.args.StandardSave(state), force=True)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


class FullyShardedCheckpoints(_Saves):
    """--fully-sharded's checkpoints: herring_jax.save_sharded of the
    FullyShardedState (each process writes only its chunks of the parameters
    and of the optimizer state, into a file of its own) in <dir>/<steps done>,
    the two latest kept. A run started with a --checkpoint-dir that holds one
    resumes after the latest complete one, on any number of processes
    (restore_sharded reads whichever files hold this process's chunks)."""

    keep = 2

    def __init__(self, args, fs, param_shapes):
        self.every = args.checkpoint_every
        if self.every < 1:
            raise SystemExit(f"--checkpoint-every must be at least 1, got {self.every}")
        self.directory = os.path.abspath(args.checkpoint_dir)
        self.fs, self.param_shapes = fs, param_shapes
        self.saved = self.complete()[-1:]

    def complete(self) -> list[int]:
        """The steps of the complete checkpoints here, oldest first (save_sharded
        writes its manifest last, under a temporary name until then)."""
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(name) for name in os.listdir(self.directory) if name.isdigit() and
                      os.path.exists(os.path.join(self.directory, name, "manifest.json")))

    def restore(self, state, opt_state):
        """Returns (state, None, steps done): the latest checkpoint, or the inputs."""
        steps = self.complete()
        if not steps:
            return state, opt_state, 0
        done = steps[-1]
        restored = herring_jax.restore_sharded(os.path.join(self.directory, str(done)), self.fs,
                                               self.param_shapes)
        return restored, opt_state, done

    def maybe_save(self, done: int, last: bool, state, _opt_state) -> None:
        if not (done % self.every == 0 or last) or done in self.saved:
            return
        herring_jax.save_sharded(os.path.join(self.directory, str(done)), self.fs, state)
        self.saved.append(done)
        # Every process has written its part (save_sharded agrees on that
        # before it returns): rank 0 alone removes what is no longer kept.
        if jax.process_index() == 0:
            for old in self.complete()[:-self.keep]:
                shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)

    def close(self) -> None:
        pass  # save_sharded has returned on every process: nothing in flight
