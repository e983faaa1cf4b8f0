"""The running children of one `herring-jax launch` run: starting them in
their own sessions, prefixing their output, waiting for the end of the run,
and stopping every process group (SIGTERM, a grace period, SIGKILL).
launch.py parses the options, builds each child's environment and runs the
job once or, with --max-restarts, again after a failure. Standard library
only."""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from herring_jax._src.process import knobs
from herring_jax._src.process.exit_status import PREEMPTED_EXIT_CODE

PROG = "herring-jax launch"
GRACE_ENV = "HERRING_LAUNCH_GRACE_S"
PREEMPTION_GRACE_ENV = "HERRING_PREEMPTION_GRACE_S"
DEFAULT_GRACE_S = knobs.KNOBS[GRACE_ENV].default
EXIT_TIMEOUT = 124
_POLL_S = 0.05
# A stop that takes longer than this is announced, with how long it may take.
_ANNOUNCE_AFTER_S = 0.5
# After a rank failed, how long the others get to end (and report) by
# themselves before SIGTERM.
_SETTLE_S = 3.0
# Once every worker has succeeded, how long the server-only processes get to
# end by themselves (they do once every worker's leave notice is in).
_SERVERS_END_S = 10.0
# A reader can only hang past the kill if something left the child's process
# group and still holds the pipe; do not let that hang the launcher too.
_READER_JOIN_S = 2.0


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_launcher():
    """Returns a Popen preexec_fn that makes the child die with this process, or None.

    The children lead their own sessions, so nothing reaches them when the
    launcher is SIGKILLed; PR_SET_PDEATHSIG (Linux) has the kernel send
    them SIGKILL then. It survives exec and is set after fork, so a
    launcher that died in between is caught by comparing getppid() with its
    pid. The kernel sends it when the thread that started the child ends:
    launch.run() starts and stops every child on one thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    # Everything is looked up here, in the parent: between fork and exec the
    # child must not import or take locks another thread may hold.
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    launcher, sigkill = os.getpid(), int(signal.SIGKILL)
    getppid, kill, getpid = os.getppid, os.kill, os.getpid

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if getppid() != launcher:  # the launcher died before prctl
            kill(getpid(), sigkill)

    return preexec


def _grace_s() -> float:
    """The SIGTERM-to-SIGKILL grace period, from HERRING_LAUNCH_GRACE_S if valid."""
    text = os.environ.get(GRACE_ENV)
    try:
        return max(0.0, float(text)) if text else DEFAULT_GRACE_S
    except ValueError:
        print(f"{PROG}: ignoring {GRACE_ENV}={text!r} (not a number); using "
              f"{DEFAULT_GRACE_S:g} s", file=sys.stderr, flush=True)
        return DEFAULT_GRACE_S


def _preemption_grace_s() -> float:
    """The ranks' preemption grace (HERRING_PREEMPTION_GRACE_S), for the
    launcher's own wait after forwarding a stop signal."""
    try:
        return knobs.get(PREEMPTION_GRACE_ENV)
    except ValueError:
        return knobs.KNOBS[PREEMPTION_GRACE_ENV].default


def _ignores_sigterm(pid: int) -> bool:
    """Whether the process has SIGTERM's disposition set to ignore (Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _exit_code(returncode: int) -> int:
    """Maps Popen.returncode to a shell-style exit code (128 + n for signal n)."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    """Says how a child ended, naming the signal if one killed it."""
    text = f"exited with code {_exit_code(returncode)}"
    names = {-s.value: s.name for s in signal.Signals}
    return f"{text} (killed by {names[returncode]})" if returncode in names else text


def _processes(count: int) -> str:
    """'1 process', '3 processes'."""
    return f"{count} process" if count == 1 else f"{count} processes"


class _Job:
    """N running children, their output readers and the events that end the job."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.lock = threading.Lock()  # one whole line at a time, across ranks and streams
        # SimpleQueue.put is reentrant, so the signal handler may use it too.
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.procs: list[subprocess.Popen] = []
        self.readers: dict[int, list[threading.Thread]] = {}
        self.waiters: list[threading.Thread] = []
        self.signals: list[int] = []
        self.preexec = _die_with_launcher()
        # (rank, returncode, how it ended) of the failure stop() reported.
        self.verdict: tuple[int, int | None, str] | None = None
        # Ranks that exited with PREEMPTED_EXIT_CODE: saved for a preemption.
        self.preempted: set[int] = set()
        self.servers: set[int] = set()  # ranks of server-only processes

    def who(self, rank: int) -> str:
        """'rank R', or 'server rank R' for a server-only process."""
        return f"server rank {rank}" if rank in self.servers else f"rank {rank}"

    def say(self, message: str) -> None:
        """Writes one launcher line to stderr without splitting a child's line."""
        self._emit(sys.stderr, f"{PROG}: {message}\n")

    def _emit(self, sink, text: str) -> None:
        with self.lock:
            try:
                try:
                    sink.write(text)
                except UnicodeEncodeError:  # e.g. an ASCII-only stdout
                    enc = getattr(sink, "encoding", None) or "ascii"
                    sink.write(text.encode(enc, "backslashreplace").decode(enc))
                sink.flush()
            except (OSError, ValueError):
                # A closed launcher stdout must not stop the draining, or the
                # child would block forever on a full pipe.
                pass

    def _pump(self, stream, sink, prefix: str) -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                self._emit(sink, prefix + (line if line.endswith("\n") else line + "\n"))

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        self.events.put(("exit", rank, proc.wait()))

    def start(self, rank: int, command: list[str], env: dict, server: bool = False) -> None:
        """Starts one child in its own session, with its reader and waiter
        threads (`server`: a server-only process, see serving.py)."""
        if server:
            self.servers.add(rank)
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=self.preexec)
        self.procs.append(proc)
        prefix = f"[rank {rank}] "
        self.readers[rank] = [
            threading.Thread(target=self._pump, args=(stream, sink, prefix), daemon=True)
            for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
        self.waiters.append(threading.Thread(target=self._wait, args=(rank, proc), daemon=True))
        for t in (*self.readers[rank], self.waiters[-1]):
            t.start()

    def on_signal(self, signum: int, _frame) -> None:
        """Signal handler: the main loop (or the grace wait) reacts to it."""
        self.signals.append(signum)
        self.events.put(("signal", signum, 0))

    def wait_for_end(self, timeout: float | None,
                     deadline: float | None = None) -> tuple[int, str | None, int | None]:
        """Blocks until every child ended (succeeded, or saved for a preemption:
        PREEMPTED_EXIT_CODE), one failed, a signal came or time ran out.

        Args:
          timeout: the --timeout to report.
          deadline: when it runs out (time.monotonic()); default: timeout from now.

        Returns:
          (exit code, the line to report or None, the failed rank or None).
        """
        if deadline is None and timeout is not None:
            deadline = time.monotonic() + timeout
        running = set(range(len(self.procs)))
        # Server-only processes run until the workers are done: the job
        # succeeds once every worker has (let_servers_end then ends them).
        while running - self.servers:
            # Bounded waits: a signal caught by another thread gets its Python
            # handler run only when this thread wakes up.
            wait_s = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            try:
                kind, what, code = self.events.get(timeout=max(0.0, wait_s))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return (EXIT_TIMEOUT, (f"timed out after {timeout:g} s; stopping all "
                                           f"{_processes(len(running))}"), None)
                continue
            if kind == "signal":
                # Ranks that save on preemption need their grace, not just ours.
                self.grace_s = max(self.grace_s, _preemption_grace_s() + 2.0)
                return (128 + what, (f"got {signal.Signals(what).name}; stopping all "
                                     f"{_processes(len(running))}"), None)
            running.discard(what)
            if code == PREEMPTED_EXIT_CODE:
                self.preempted.add(what)
            elif code != 0:
                tail = f"; stopping the other {_processes(len(running))}" if running else ""
                return _exit_code(code), f"{self.who(what)} {_describe(code)}{tail}", what
        return (PREEMPTED_EXIT_CODE if self.preempted else 0), None, None

    def ended_preempted(self) -> bool:
        """Whether every child has ended, each with status 0 or
        PREEMPTED_EXIT_CODE and one at least with the latter (server-only
        processes aside: stopped with the job, they hold no training state)."""
        codes = [proc.poll() for rank, proc in enumerate(self.procs) if rank not in self.servers]
        return (PREEMPTED_EXIT_CODE in codes
                and all(code in (0, PREEMPTED_EXIT_CODE) for code in codes))

    def _blame(self, rank: int, message: str | None) -> tuple[int, str | None]:
        """The rank to name for the failure, once the others had their moment
        to end by themselves: `rank`, the first exit the launcher saw, unless
        it exited with a code and another rank died by a signal. A SIGKILLed
        rank's peers fail (status 1) within a moment, and on a busy machine the
        launcher may see one of them end first. Sets self.verdict."""
        first = self.procs[rank].returncode
        if first is not None and first >= 0:
            later = []
            while True:
                try:
                    kind, what, code = self.events.get_nowait()
                except queue.Empty:
                    break
                if kind == "exit":
                    later.append((what, code))
                else:
                    self.events.put((kind, what, code))  # a signal: left for the caller
                    break
            # Exits whose waiter has not reported yet count too (after those that have).
            killed = [(r, code) for r, code in later if code < 0] + [
                (r, p.returncode) for r, p in enumerate(self.procs)
                if p.poll() is not None and p.returncode < 0 and r not in dict(later)]
            if killed:
                r, code = killed[0]
                tail = message.split(";", 1)[1] if message and ";" in message else ""
                self.verdict = (r, code, _describe(code))
                return r, (f"{self.who(r)} {_describe(code)} ({self.who(rank)} "
                           f"{_describe(first)} a moment earlier);{tail}")
        self.verdict = (rank, first, _describe(first) if first is not None else "")
        return rank, message

    def _signal_groups(self, sig: int) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # the whole group is gone already

    def _any_alive(self) -> bool:
        if any(proc.returncode is None for proc in self.procs):
            return True
        for proc in self.procs:
            try:
                os.killpg(proc.pid, 0)
                return True
            except (ProcessLookupError, PermissionError):
                pass
        return False

    def stop(self, message: str | None = None, failed_rank: int | None = None) -> None:
        """Ends every child's process group (SIGTERM, grace, SIGKILL) and joins threads.

        Groups are signalled even when their leader has exited, so that what a
        rank started in the background dies with the job.

        Args:
          message: the launcher's verdict, written to stderr once SIGTERM is sent.
          failed_rank: the rank whose last output should come before the verdict.
        """
        signals_before = len(self.signals)
        if failed_rank is not None:
            # herring_jax has told the other ranks of the failure: those waiting
            # for the failed rank end by themselves within a moment, each naming
            # it and its exception; SIGTERM now would cut that report off.
            settle = time.monotonic() + min(_SETTLE_S, self.grace_s)
            while (time.monotonic() < settle and len(self.signals) == signals_before
                   and any(proc.poll() is None for proc in self.procs)):
                time.sleep(_POLL_S)
            failed_rank, message = self._blame(failed_rank, message)
        self._signal_groups(signal.SIGTERM)
        end = time.monotonic() + self.grace_s
        # A process that ignores SIGTERM outright gets no grace: it cannot
        # act on it.
        for proc in self.procs:
            if proc.poll() is None and _ignores_sigterm(proc.pid):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if failed_rank is not None:
            # Its last words (usually a traceback) belong before the verdict;
            # SIGTERM first, so a grandchild holding its pipes lets go of them.
            for t in self.readers[failed_rank]:
                t.join(max(0.0, min(_READER_JOIN_S, end - time.monotonic())))
        if message:
            self.say(message)
        # A second Ctrl-C means "now": skip the rest of the grace period.
        announced = False
        while (self._any_alive() and time.monotonic() < end
               and len(self.signals) == signals_before):
            if not announced and end - time.monotonic() < self.grace_s - _ANNOUNCE_AFTER_S:
                alive = sum(proc.poll() is None for proc in self.procs)
                why = GRACE_ENV if self.grace_s == _grace_s() else \
                    f"{PREEMPTION_GRACE_ENV} + 2 s"
                self.say(f"waiting up to {self.grace_s:g} s ({why}) for "
                         f"{_processes(max(alive, 1))} to exit after SIGTERM, then SIGKILL "
                         "(Ctrl-C again: at once)")
                announced = True
            time.sleep(_POLL_S)
        self._signal_groups(signal.SIGKILL)
        for t in self.waiters:
            t.join()  # reaps every child: no zombies
        for threads in self.readers.values():
            for t in threads:
                t.join(_READER_JOIN_S)

    def let_servers_end(self) -> None:
        """After every worker succeeded: waits up to _SERVERS_END_S for the
        server-only processes to end by themselves (stop() ends the rest)."""
        end = time.monotonic() + _SERVERS_END_S
        while (time.monotonic() < end and not self.signals
               and any(self.procs[r].poll() is None for r in self.servers)):
            time.sleep(_POLL_S)
