"""Checkpoints of sharded_optimizer (save_sharded / restore_sharded): restored
onto another number of processes, bitwise; no file written by two processes
and no writable memory map (on NFS and object-store mounts those overwrite a
neighbour's bytes); read with numpy alone by the recipe of
docs/guides/sharded.md; version 1's checkpoints still restored; a save that
fails on one process raising the same error on every process at once.

The bitwise comparisons run with XLA_FLAGS=--xla_backend_optimization_level=0
(see test_sharded.py)."""

import hashlib
import json
import pathlib
import re
from collections import defaultdict

import ml_dtypes
import numpy as np
import pytest

from multiproc import BITWISE_COMPILE, assert_all_ok, assert_each_file_has_one_writer, launch

BITWISE = {"XLA_FLAGS": BITWISE_COMPILE}
ROOT = pathlib.Path(__file__).resolve().parent.parent


def docs_recipe():
    """read_checkpoint, as docs/guides/sharded.md gives it."""
    page = (ROOT / "docs" / "guides" / "sharded.md").read_text()
    [code] = [b for b in re.findall(r"```python\n(.*?)```", page, re.S)
              if "def read_checkpoint" in b]
    namespace = {}
    exec(compile(code, "sharded.md", "exec"), namespace)
    return namespace["read_checkpoint"]


def write_version_1(src: pathlib.Path, dst: pathlib.Path, read_checkpoint):
    """The checkpoint at `src` in version 1's layout: one whole .npy per leaf."""
    manifest = json.loads((src / "manifest.json").read_text())
    state, params = read_checkpoint(str(src))
    for kind, leaves in (("state", state), ("params", params)):
        (dst / kind).mkdir(parents=True)
        for k, x in enumerate(leaves):
            np.save(dst / kind / f"{k}.npy", x)
    assert manifest["residuals"] == 0
    (dst / "manifest.json").write_text(json.dumps({
        "format": "herring_jax sharded optimizer state, version 1",
        "processes": manifest["processes"], "residuals": 0,
        "state": [{k: e[k] for k in ("path", "param", "shape", "dtype")}
                  for e in manifest["state"]],
        "params": [{k: e[k] for k in ("shape", "dtype")} for e in manifest["params"]]}))


@pytest.mark.parametrize("save,resume,old,dtype", [(4, 2, False, "float32"),
                                                 (2, 3, True, "bfloat16")])
def test_a_checkpoint_resumes_on_another_number_of_processes(tmp_path, save, resume, old, dtype):
    # Leaves that 2, 3 and 4 do not divide (padded chunks) and a scalar
    # (empty chunks on all but one process); bfloat16, which numpy cannot
    # name in a file, stored as its bits.
    # Also fully_sharded's checkpoint (its parameters are chunks too).
    saved = launch("reshard_worker.py", ["save", "--dir", str(tmp_path), "--dtype", dtype,
                                         "--fully"], nproc=save, env=BITWISE)
    assert_all_ok(saved, expected_cases=2)
    assert_each_file_has_one_writer(saved, tmp_path, ("save", "save-fully"))
    # numpy alone reads the parameters trained.
    read_checkpoint = docs_recipe()
    manifest = json.loads((tmp_path / "sharded" / "manifest.json").read_text())
    assert manifest["processes"] == save
    _, params = read_checkpoint(str(tmp_path / "sharded"))
    assert [list(p.shape) for p in params] == [m["shape"] for m in manifest["params"]]
    assert {m["dtype"] for m in manifest["params"]} == {dtype}
    params = [p.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else p for p in params]
    whole = np.concatenate([np.ravel(p.astype(np.float64)) for p in params])
    digest = hashlib.sha256(whole.tobytes()).hexdigest()[:16]
    [save] = [r for r in saved.results[0] if r["case"] == "save"]
    assert digest == save["digest"], (digest, saved.results[0])
    _, fully_params = read_checkpoint(str(tmp_path / "fully"))
    assert [a.tobytes() for a in fully_params] == [b.tobytes() for b in params], \
        "fully_sharded's parameters differ from sharded_optimizer's"
    names = ["sharded", "fully"]
    if old:
        write_version_1(tmp_path / "sharded", tmp_path / "old", read_checkpoint)
        names.append("old")
    resumed = launch("reshard_worker.py", ["resume", "--dir", str(tmp_path), "--dtype", dtype,
                                           "--names", ",".join(names)],
                     nproc=resume, env=BITWISE)
    digests = assert_all_ok(resumed, expected_cases=len(names))
    # Every process, from either checkpoint, ends with the parameters of the
    # unsharded chain resumed from its own checkpoint.
    assert len(set().union(*digests.values())) == 1, digests


TIMEOUT_S = 60


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """checkpoint_failure_worker's cases on 2 processes: case -> rank -> report."""
    root = tmp_path_factory.mktemp("failures")
    (root / "exists").mkdir()
    # The codec on the wire (no host stage), so that the state holds a
    # non-zero error-feedback residual whose save and restore show.
    run = launch("checkpoint_failure_worker.py", ["--dir", str(root)], nproc=2,
                 env={"HERRING_TIMEOUT_S": str(TIMEOUT_S), "HERRING_HOST_STAGE": "0"},
                 timeout=300)
    assert_all_ok(run, expected_cases=9)
    cases = defaultdict(dict)
    for rank, results in run.results.items():
        for r in results:
            cases[r["case"]][rank] = r
    return root, cases


def test_a_failed_save_raises_on_every_process_at_once(failures):
    root, cases = failures
    problems = []
    for case, failing, kind, words in (("exists", 0, "FileExistsError", "exists"),
                                       ("full", 1, "OSError", "No space left on device")):
        got = cases[case]
        # The same error on both processes, naming the process it happened on.
        if {(r["type"], r["text"]) for r in got.values()} != {(kind, got[0]["text"])}:
            problems.append(f"{case}: not the same {kind} on every process")
        if f"failed on rank {failing}" not in got[0]["text"] or words not in got[0]["text"]:
            problems.append(f"{case}: the error does not name rank {failing} and '{words}'")
        if any(r["manifest"] for r in got.values()):
            problems.append(f"{case}: a manifest was written")
        # Far sooner than the HERRING_TIMEOUT_S a barrier would wait.
        if not all(r["seconds"] < TIMEOUT_S / 3 for r in got.values()):
            problems.append(f"{case}: a process raised only after HERRING_TIMEOUT_S")
    assert not problems, (problems, dict(cases))
    assert not (root / "full").exists()
    # The failed saves' outcomes were deleted from the key-value store once
    # a save completed: only its own three steps' keys are left.
    assert len(cases["after"][0]["checkpoint_keys"]) == 3 * 2, cases["after"][0]


def test_a_damaged_checkpoint_is_refused_with_a_clear_error(failures):
    _, cases = failures
    for rank in range(2):
        got = {case: cases[case][rank] for case in ("missing", "truncated", "format")}
        assert got["missing"]["type"] == "FileNotFoundError", got["missing"]
        assert "incomplete" in got["missing"]["text"], got["missing"]
        assert got["truncated"]["type"] == "ValueError", got["truncated"]
        assert "shards/1.npz" in got["truncated"]["text"], got["truncated"]
        assert "truncated" in got["truncated"]["text"], got["truncated"]
        assert got["format"]["type"] == "ValueError", got["format"]
        assert "version 9" in got["format"]["text"], got["format"]


def test_a_killed_save_leaves_nothing_after_the_next_save(failures):
    root, cases = failures
    # The failed save's and a killed save's `.partial-<gen>` directories are
    # gone once the next save has completed.
    assert cases["after"][0]["partials"] == [], cases["after"][0]
    assert not any(".partial-" in p.name for p in root.iterdir() if p.name != "ok"), \
        sorted(p.name for p in root.iterdir())


def test_restoring_into_other_dtypes_is_refused_unless_cast(failures):
    _, cases = failures
    for rank in range(2):
        got = cases["dtype"][rank]
        assert got["type"] == "ValueError", got
        assert "params['dense']['bias'] as float32" in got["text"], got
        assert "make it bfloat16" in got["text"] and "cast=True" in got["text"], got
        assert cases["dtype-cast"][rank]["ok"], cases["dtype-cast"][rank]


def test_restoring_another_model_names_the_leaf_and_both_shapes(failures):
    _, cases = failures
    for rank in range(2):
        got = cases["other-model"][rank]
        assert got["type"] == "ValueError", got
        assert "params['dense']['kernel'] has shape (40, 23) here, (37, 23) in the checkpoint" \
            in got["text"], got
