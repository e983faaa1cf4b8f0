"""HERRING_TIMELINE: a 2-process training run writes one Chrome trace per
process that parses as JSON and holds every reduction, named, nested and in
rows whose slices do not overlap; `herring-jax timeline` merges them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from herring_jax._src.process import timeline

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _slices(events):
    return [e for e in events if e.get("ph") == "X"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("timeline")
    env = dict(os.environ, JAX_PLATFORMS="cpu", HERRING_TIMEOUT_S="120",
               HERRING_TIMELINE=str(tmp / "trace.json"))
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "herring_jax.launch", "-n", "2", "--timeout", "300", "--",
           sys.executable, "demo_train.py", "--steps", "6", "--plot", ""]
    proc = subprocess.run(cmd, cwd=EXAMPLES, env=env, capture_output=True, text=True,
                          timeout=330)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return tmp


def test_each_process_writes_a_chrome_trace(traces):
    for rank in range(2):
        path = traces / f"trace.rank{rank}.json"
        events = json.loads(path.read_text())  # complete JSON, not only loadable
        meta = {e["name"]: e for e in events if e["ph"] == "M" and "tid" not in e}
        assert meta["process_name"]["args"]["name"] == f"herring_jax rank {rank} of 2"
        assert f"rank {rank} of 2" in meta["process_labels"]["args"]["labels"]
        assert all(e["pid"] == rank for e in events)
        threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        slices = _slices(events)
        reductions = [e for e in slices if e["cat"] == "herring" and "args" in e]
        # Each training step reduces its gradients (one bucket or more) and
        # its loss; the end adds a broadcast and the check's sum.
        grads = [e for e in reductions if e["name"].startswith("mean float32[")
                 and "demo_train.py:" in e["name"]]
        assert len(grads) >= 6, [e["name"] for e in reductions]
        assert any(e["name"].startswith("broadcast from 0 ") for e in reductions)
        for e in reductions:
            assert e["tid"] in threads and e["dur"] >= 0 and e["args"]["ok"]
            assert e["args"]["bytes"] > 0
        # Inside each reduction: the wait for a thread, then the reduction.
        by_tid = {}
        for e in slices:
            by_tid.setdefault(e["tid"], []).append(e)
        for rows in by_tid.values():
            parents = sorted((e for e in rows if "args" in e), key=lambda e: e["ts"])
            for a, b in zip(parents, parents[1:]):
                assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)  # rows never overlap
            for p in parents:
                inside = [c for c in rows if "args" not in c
                          and p["ts"] - 1e-3 <= c["ts"] <= p["ts"] + p["dur"] + 1e-3]
                assert {c["name"] for c in inside} >= {"waiting for a herring thread",
                                                       "reducing (host stage and wire)"}


def test_merged_trace_holds_both_processes(traces):
    out = traces / "merged.json"
    proc = subprocess.run([sys.executable, "-P", "-m", "herring_jax._src.cli", "timeline",
                           str(traces / "trace.rank0.json"), str(traces / "trace.rank1.json"),
                           "-o", str(out)], cwd=traces, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    events = json.loads(out.read_text())
    assert {e["pid"] for e in events} == {0, 1}
    assert len(events) == sum(len(timeline.load(str(traces / f"trace.rank{r}.json")))
                              for r in range(2))


def test_file_names_and_a_trace_cut_short(tmp_path):
    assert timeline.file_for("/x/trace.json", 3) == "/x/trace.rank3.json"
    assert timeline.file_for("/x/t-{rank}.trace", 1) == "/x/t-1.trace"
    assert timeline.file_for("trace", 0) == "trace.rank0.json"
    cut = tmp_path / "cut.json"
    cut.write_text('[\n{"name": "a", "ph": "X", "ts": 1, "dur": 2, "pid": 0, "tid": 1},\n')
    assert timeline.load(str(cut))[0]["name"] == "a"


def test_merge_moves_other_boots_onto_the_first_clock(tmp_path):
    def trace(path, boot, mono, unix, ts):
        path.write_text(json.dumps([
            {"name": "herring_clock", "ph": "M", "pid": 0,
             "args": {"boot_id": boot, "monotonic_ns": mono, "unix_ns": unix}},
            {"name": "r", "ph": "X", "ts": ts, "dur": 1, "pid": 0, "tid": 1}]))
    trace(tmp_path / "a.json", "A", 1_000_000, 5_000_000, 10.0)
    trace(tmp_path / "b.json", "B", 3_000_000, 5_000_000, 10.0)  # its clock started 2 ms early
    timeline.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")],
                   str(tmp_path / "m.json"))
    ts = [e["ts"] for e in json.loads((tmp_path / "m.json").read_text()) if e["ph"] == "X"]
    assert ts == [10.0, 10.0 - 2000.0]
