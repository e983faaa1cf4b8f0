"""HERRING_TIMELINE: each process's reductions as a Chrome trace.

With ``HERRING_TIMELINE=trace.json`` every process writes its own file,
``trace.rank<R>.json`` (or the path with ``{rank}`` replaced), in Chrome's
trace event format, which https://ui.perfetto.dev and chrome://tracing open
(as Horovod's HOROVOD_TIMELINE does for its operations). Each reduction is
one slice from the moment XLA issued it to the moment its result was complete,
named by what was reduced and where the program wrote it, with two slices
inside: waiting for one of herring's threads, and the reduction itself (host
stage and wire). Overlapping reductions go to separate rows ("threads").
`herring-jax timeline` merges the files of a job into one trace.

The engine records the events (xla_ffi/engine/timeline.h, the last 16384);
a thread of this module takes them every second and appends them, and
shutdown() and the interpreter's exit take the rest; so does the fast exit
after an uncaught exception (HERRING_FAST_EXIT), which skips the exit
handlers, its failed reduction's slice among them. After every append the
file is a complete JSON array; a process that dies between appends leaves the
closing bracket out, which both viewers accept.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import threading
import time

import numpy as np

from herring_jax._src.process import knobs

# The engine keeps at most this many events between takes; a take each
# second stays well below it at any rate a training job reduces.
_PERIOD_S = 1.0

_lock = threading.Lock()
# (key, slot) -> what the reduction is and where it was written (lowering.py).
_labels: dict[tuple[int, int], str] = {}
# Events taken for the trace that runtime.take_timeline() has not returned yet
# (the overlap benchmark reads them too); bounded like the engine's own.
_unclaimed: collections.deque = collections.deque(maxlen=1 << 14)
_writer: "_Writer | None" = None


def describe(op: str, avals, codec: str, collective: str, root: int | None) -> str:
    """A reduction's name in the trace, e.g. 'mean float32[1000] @int8'."""
    kind = f"broadcast from {root}" if root is not None else op
    if collective != "allreduce":
        kind = f"{collective} {kind}"
    shapes = [f"{np.dtype(a.dtype).name}[{','.join(map(str, a.shape))}]" for a in avals]
    what = f"{kind} {shapes[0]}" if shapes else kind
    if len(shapes) > 1:
        what += f" +{len(shapes) - 1} more"
    return what if codec == "none" else f"{what} @{codec}"


def note(key: int, slot: int, what: str, site: str | None) -> None:
    """Names the reductions of (key, slot) in traces (lowering.py, per call site)."""
    _labels[(int(key), int(slot))] = f"{what} at {site}" if site else what


def file_for(path: str, rank: int) -> str:
    """This rank's file: PATH with {rank} replaced, else with .rank<R> before
    its extension (trace.json -> trace.rank0.json)."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext or '.json'}"


def start(rank: int, size: int, description: str, devices: dict[int, int]) -> None:
    """Starts this process's trace where HERRING_TIMELINE asks (initialize()).

    `devices` maps the device numbers the handlers see (XLA's DeviceOrdinal:
    the global id on XLA:CPU) to the process-local index shown in the trace.
    """
    global _writer
    path = knobs.get("HERRING_TIMELINE")
    if not path:
        return
    with _lock:
        target = file_for(path, rank)
        if _writer is not None and _writer.path == target:
            return  # initialize() again in the same process: append
        if _writer is not None:
            _writer.close()
        _writer = _Writer(target, rank, size, description, devices)
    threading.Thread(target=_flush_periodically, args=(_writer,), name="herring-timeline",
                     daemon=True).start()
    atexit.register(flush)


def flush() -> None:
    """Appends the events recorded since the last flush to the trace."""
    with _lock:
        if _writer is not None:
            _take_locked()


def writing() -> bool:
    """Whether this process writes a trace (HERRING_TIMELINE)."""
    return _writer is not None and not _writer.closed


def flush_before_exit(timeout_s: float = 2.0) -> None:
    """The last flush of a process that ends without its exit handlers
    (errors.exit_now, after an uncaught exception): appends what the engine
    recorded, the failed reduction's slice among it, and closes the file, so
    that no periodic append is cut short by the exit. A flush that holds the
    file longer than `timeout_s` (a file system that hangs) is given up on:
    the exit must not wait for it."""
    if not _lock.acquire(timeout=timeout_s):
        return
    try:
        if _writer is not None and not _writer.closed:
            _take_locked()
            _writer.close()
    finally:
        _lock.release()


def take() -> list[dict]:
    """The events since the last take(), oldest first (runtime.take_timeline)."""
    with _lock:
        events = _take_locked()
        if _writer is None:
            return events
        out = list(_unclaimed)
        _unclaimed.clear()
        return out


def _take_locked() -> list[dict]:
    from herring_jax import _herring_ffi  # loaded with runtime, which calls this
    events = list(_herring_ffi.take_timeline())
    if _writer is not None and events:
        _writer.append(events)
        _unclaimed.extend(events)
    return events


def _flush_periodically(writer: "_Writer") -> None:
    while not writer.closed:
        time.sleep(_PERIOD_S)
        flush()


class _Writer:
    """One process's trace file, a JSON array kept complete after each append."""

    def __init__(self, path: str, rank: int, size: int, description: str,
                 devices: dict[int, int]):
        self.path, self.rank, self.devices, self.closed = path, rank, devices, False
        self._lanes: dict[int, list[int]] = {}  # device -> end of each row's last slice
        self._tids: dict[tuple[int, int], int] = {}
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._file = open(path, "w+", encoding="utf-8")
        # Other hosts' monotonic clocks start elsewhere: merge() aligns files
        # of different boots by the wall clock taken at the same moment.
        clock = {"boot_id": _boot_id(), "monotonic_ns": time.monotonic_ns(),
                 "unix_ns": time.time_ns()}
        head = [
            {"name": "process_name", "ph": "M", "pid": rank,
             "args": {"name": f"herring_jax rank {rank} of {size}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
            {"name": "process_labels", "ph": "M", "pid": rank, "args": {"labels": description}},
            {"name": "herring_clock", "ph": "M", "pid": rank, "args": clock},
        ]
        self._file.write("[\n" + ",\n".join(json.dumps(e) for e in head) + "\n]\n")
        self._file.flush()

    def _tid(self, device: int, issued: int, ended: int) -> tuple[int, list[dict]]:
        """A row of this device whose last slice ended before `issued`
        (slices in one row must not overlap), and its name if it is new."""
        ends = self._lanes.setdefault(device, [])
        for lane, end in enumerate(ends):
            if end <= issued:
                ends[lane] = ended
                break
        else:
            lane = len(ends)
            ends.append(ended)
        if (device, lane) in self._tids:
            return self._tids[(device, lane)], []
        tid = len(self._tids) + 1
        self._tids[(device, lane)] = tid
        name = (f"reductions, device {self.devices.get(device, device)}"
                + (f" ({lane + 1})" if lane else ""))
        return tid, [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                      "args": {"name": name}},
                     {"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": tid,
                      "args": {"sort_index": tid}}]

    def append(self, events: list[dict]) -> None:
        out = []
        for e in sorted(events, key=lambda e: e["issued_ns"]):
            issued, begun, ended = e["issued_ns"], e["begun_ns"], e["ended_ns"]
            tid, names = self._tid(e["device"], issued, ended)
            out += names
            name = _labels.get((e["key"], e["slot"]), f"reduction (slot {e['slot']})")
            common = {"cat": "herring", "ph": "X", "pid": self.rank, "tid": tid}
            args = {"bytes": e["bytes"], "device": e["device"], "slot": e["slot"],
                    "key": f"{e['key']:#x}", "ok": e["ok"],
                    "waited_for_thread_us": (begun - issued) / 1e3,
                    "reduced_us": (ended - begun) / 1e3}
            out.append(dict(common, name=name if e["ok"] else f"FAILED {name}",
                            ts=issued / 1e3, dur=(ended - issued) / 1e3, args=args))
            out.append(dict(common, name="waiting for a herring thread", ts=issued / 1e3,
                            dur=(begun - issued) / 1e3))
            out.append(dict(common, name="reducing (host stage and wire)", ts=begun / 1e3,
                            dur=(ended - begun) / 1e3))
        if not out or self.closed:
            return
        self._file.seek(0, os.SEEK_END)
        self._file.seek(self._file.tell() - 2)  # over the closing "]\n"
        self._file.write(",\n" + ",\n".join(json.dumps(e) for e in out) + "\n]\n")
        self._file.flush()

    def close(self) -> None:
        self.closed = True
        self._file.close()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def load(path: str) -> list[dict]:
    """The events of a trace file, also of one whose closing bracket is missing."""
    with open(path, encoding="utf-8") as f:
        text = f.read().rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return json.loads(text)


def merge(paths: list[str], out: str) -> int:
    """Writes the events of several processes' traces into one; returns how
    many. Files written on other boots (hosts) are shifted onto the first
    file's clock by the wall clock each recorded at its start."""
    merged, base = [], None
    for path in paths:
        events = load(path)
        clock = next((e["args"] for e in events if e.get("name") == "herring_clock"), None)
        shift_us = 0.0
        if clock is not None:
            if base is None:
                base = clock
            elif clock["boot_id"] != base["boot_id"]:
                offset = (clock["unix_ns"] - clock["monotonic_ns"]) - (
                    base["unix_ns"] - base["monotonic_ns"])
                shift_us = offset / 1e3
        for e in events:
            if shift_us and "ts" in e:
                e = dict(e, ts=e["ts"] + shift_us)
            merged.append(e)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(merged, f)
    return len(merged)


def add_arguments(parser) -> None:
    """The options of `herring-jax timeline`."""
    parser.add_argument("traces", nargs="+", metavar="TRACE",
                        help="the processes' files written under HERRING_TIMELINE")
    parser.add_argument("-o", "--output", required=True, help="the merged trace to write")


def run(args) -> int:
    """`herring-jax timeline`: merges the traces into one file for Perfetto."""
    count = merge(args.traces, args.output)
    print(f"{args.output}: {count} events from {len(args.traces)} files; open it in "
          "https://ui.perfetto.dev or chrome://tracing")
    return 0
