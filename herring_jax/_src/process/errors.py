"""Exception types raised by herring_jax, and the translation of failed
reductions inside compiled functions into HerringError."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import traceback

import jax

from herring_jax._src.process import install_dirs

# Every error the FFI handlers return starts with this (handler_common.h);
# jax raises it as JaxRuntimeError("INTERNAL: herring allreduce on rank R: ...").
_MARKER = "herring allreduce on rank "
# What XLA puts before it: the status code's name, and "Error dispatching
# computation: " once for every computation the failure passed through (each
# queued step that depended on the failed one).
_XLA_PREFIX = re.compile(r"^(?:[A-Z_]+: |Error dispatching computation: )*(?=" + _MARKER + ")")


class HerringError(jax.errors.JaxRuntimeError):
    """A reduction or the communicator failed at run time.

    Raised when a peer process died, hung or became unreachable (after
    ``HERRING_PEER_TIMEOUT_S`` without a heartbeat, at most
    ``HERRING_TIMEOUT_S``), when processes issued different reductions
    (shapes, dtypes, ops or order), or when the transport could not be
    opened. The message names the ranks, the reduction and what to do.

    It subclasses ``jax.errors.JaxRuntimeError`` (and so ``RuntimeError``).
    A reduction that fails inside a user's jitted function reaches Python
    through jaxlib: from :func:`herring_jax.initialize` on, every
    JaxRuntimeError jaxlib makes of a herring failure is made a HerringError
    (see :func:`install_error_translation`), whichever call awaited it. One
    path jaxlib 0.10 raises as ``ValueError`` instead (0.12 does not), the
    C++ dispatch of a compiled function whose program fails while it is
    dispatched;
    :func:`herring_errors` and the handler for uncaught exceptions turn those
    into this class too (docs/guides/failures.md, "Which exception").
    """

    def __init__(self, message="", *args, **kwargs):
        # Made by jaxlib (install_error_translation), the message carries
        # XLA's prefixes: herring's own text says it all.
        if isinstance(message, str):
            message = _XLA_PREFIX.sub("", message, count=1)
        super().__init__(message, *args, **kwargs)


HerringError.__module__ = "herring_jax"  # tracebacks name the public class

_translation_lock = threading.Lock()
_translation_installed = False


def install_error_translation() -> None:
    """Makes jaxlib raise every failed herring reduction as HerringError
    (idempotent).

    jaxlib makes a JaxRuntimeError of a failed computation's status (by
    calling the class) wherever a result is awaited: block_until_ready, a
    pytree's, float(), numpy.asarray(), jax.device_get(), and the dispatch
    that runs through jax's Python path. Those whose message is a herring
    handler's are made HerringError instead, a subclass: code that catches
    JaxRuntimeError or RuntimeError catches them as before. The one other
    way a failure reaches Python, jaxlib 0.10's C++ dispatch's ValueError, is
    set by jaxlib without making an object of any class herring_jax can
    change; herring_errors() converts it.
    """
    global _translation_installed
    with _translation_lock:
        if _translation_installed:
            return
        base = jax.errors.JaxRuntimeError
        make = base.__new__  # BaseException's: jaxlib's class defines none

        def new(cls, *args, **kwargs):
            if cls is base and args and isinstance(args[0], str) and _MARKER in args[0]:
                cls = HerringError
            return make(cls, *args, **kwargs)

        base.__new__ = staticmethod(new)
        _translation_installed = True


def as_herring_error(exc: BaseException) -> BaseException:
    """Returns `exc` as a HerringError if it is a failed herring reduction.

    jax raises a reduction that failed inside a compiled function as
    JaxRuntimeError (when the result is awaited) or ValueError (when the call
    itself ran it), its message prefixed by XLA once per computation it passed
    through. The HerringError returned carries herring's own message and the
    original traceback. Other exceptions come back unchanged.
    """
    if isinstance(exc, HerringError) or _MARKER not in str(exc):
        return exc
    # XLA prefixes a failure with "INTERNAL: Error dispatching computation: "
    # once for every computation it passed through (each queued step that
    # depended on the failed one): herring's own text says it all.
    if not isinstance(exc, (jax.errors.JaxRuntimeError, ValueError)):
        return exc
    text = str(exc)
    new = HerringError(text[text.index(_MARKER):]).with_traceback(exc.__traceback__)
    # Not chained: jax's exception says the same with the prefixes.
    new.__suppress_context__ = True
    return new


class herring_errors(contextlib.ContextDecorator):
    """Context manager and decorator: failed reductions raise HerringError.

    Inside a user's ``jax.jit`` function, a failed reduction reaches Python as
    ``HerringError`` wherever jax awaits a result, but (jax 0.10) as
    ``ValueError`` from jax's C++ dispatch of a jitted function whose program
    fails while it is dispatched (on XLA:CPU a program of under 1000 flops
    whose inputs are ready). Code run under
    ``with herring_jax.herring_errors():`` (or a function decorated with
    ``@herring_jax.herring_errors()``) sees those as ``HerringError`` too;
    other exceptions pass unchanged.

    Example:
      >>> with herring_jax.herring_errors():          # doctest: +SKIP
      ...     for batch in data:
      ...         state, loss = train_step(state, batch)
      ...     print(float(loss))
    """

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            return False
        herring = as_herring_error(exc)
        if herring is not exc:
            raise herring
        return False  # not a herring failure: re-raised as it is


_hook_lock = threading.Lock()
_hook_installed = False
# Set by runtime.initialize(): tells every other rank that this process fails,
# with the text given ("RuntimeError: ..."), and returns whether there were
# any; None before.
_abort_peers = None
# What the other ranks are told at most (their error quotes it).
_REASON_CHARS = 1500


def set_abort_peers(abort) -> None:
    global _abort_peers
    _abort_peers = abort


# Set by runtime.initialize(): what must happen before a fast exit skips the
# exit handlers (the timeline's last events written); None before.
_before_exit = None


def set_before_exit(before) -> None:
    global _before_exit
    _before_exit = before


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not block the exit
            pass


def exit_now(exc: BaseException) -> None:
    """Ends the process at once without its exit handlers (HERRING_FAST_EXIT)
    as the uncaught `exc` would end it: by SIGINT for a KeyboardInterrupt,
    as CPython does (so a shell or the launcher sees the Ctrl-C: status 130),
    else with status 1."""
    _flush_streams()  # the report first: _before_exit tells others it is out
    if _before_exit is not None:
        try:
            _before_exit()
        except Exception as e:  # noqa: BLE001 - the exit must still happen
            sys.stderr.write(f"herring_jax: before exiting: {type(e).__name__}: {e}\n")
            _flush_streams()
    if isinstance(exc, KeyboardInterrupt):
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except (OSError, ValueError):  # ValueError: not the main thread
            pass
        os._exit(128 + signal.SIGINT)  # CPython's own status where the signal did not end it
    os._exit(1)


def failure_reason(exc: BaseException) -> str:
    """What the other ranks' errors quote: the exception's type and message."""
    text = f"{type(exc).__name__}: {exc}".strip()
    if len(text) > _REASON_CHARS:
        text = text[:_REASON_CHARS] + " [...]"
    return text + " (uncaught; its traceback is in that rank's output)"


def format_uncaught(herring: HerringError, verbose: bool) -> str:
    """An uncaught HerringError as printed. First what the error says (what
    failed, which rank, where the ranks were), then where the program raised
    it: its own frames, without those of herring_jax and the libraries it
    works with (install_dirs.LIBRARIES), which say nothing more. `verbose`
    (HERRING_VERBOSE_ERRORS): Python's whole traceback instead."""
    if verbose:
        return "".join(traceback.format_exception(HerringError, herring, herring.__traceback__))
    frames = traceback.extract_tb(herring.__traceback__)
    own = [f for f in frames if not install_dirs.in_library(f.filename)]
    left = len(frames) - len(own)
    head = "Raised in (most recent call last"
    if left:
        head += (f"; {left} frame(s) in herring_jax and the libraries it works with "
                 f"({', '.join(install_dirs.LIBRARIES)}) left out, "
                 "HERRING_VERBOSE_ERRORS=1 prints them")
    return "".join([*traceback.format_exception_only(HerringError, herring), head + "):\n",
                    *traceback.format_list(own)])


def install_excepthook(fast_exit: bool = True) -> None:
    """Makes an uncaught exception end the whole job quickly (idempotent).

    For any exception that reaches the top of the main thread (not
    SystemExit), the other ranks are told first, each naming this one and the
    exception ("rank 1 failed: RuntimeError: ..."), so that none waits for
    this rank until a timeout; a failed reduction prints as HerringError,
    its traceback without the frames of herring_jax, jax and jaxlib unless
    HERRING_VERBOSE_ERRORS=1 (format_uncaught).
    With `fast_exit` (HERRING_FAST_EXIT) the process then ends at once with
    status 1 (by SIGINT for a KeyboardInterrupt, as Python's own exit; see
    exit_now) instead of running its exit handlers, having written the
    timeline's last events (HERRING_TIMELINE): jax.distributed's shutdown
    barrier would otherwise wait up to 5 minutes for ranks that have failed
    too. `herring-jax launch` sees the failure and stops the other ranks.
    """
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        previous = sys.excepthook

        def hook(exc_type, exc, tb):
            herring = None if exc is None else as_herring_error(exc)
            told = False
            if _abort_peers is not None and exc is not None:
                try:
                    told = _abort_peers(failure_reason(herring))
                except Exception as e:  # noqa: BLE001 - the report below must still happen
                    sys.stderr.write(f"herring_jax: could not tell the other ranks: {e}\n")
            if isinstance(herring, HerringError) and previous is sys.__excepthook__:
                # Python's own printing, less the frames of the libraries.
                from herring_jax._src.process import knobs
                sys.stderr.write(format_uncaught(herring, knobs.get("HERRING_VERBOSE_ERRORS")))
                sys.stderr.flush()
            elif isinstance(herring, HerringError):
                previous(HerringError, herring, herring.__traceback__)
            else:
                previous(exc_type, exc, tb)
            if fast_exit and (told or isinstance(herring, HerringError)):
                sys.stderr.write(f"herring_jax: exiting at once after an uncaught "
                                 f"{type(herring).__name__} (HERRING_FAST_EXIT=0 runs exit "
                                 "handlers instead)\n")
                exit_now(herring)

        sys.excepthook = hook
        _hook_installed = True
