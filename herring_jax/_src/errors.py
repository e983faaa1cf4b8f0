"""Exception types raised by herring_jax, and the translation of failed
reductions inside compiled functions into HerringError."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import jax

# Every error the FFI handlers return starts with this (handler_common.h);
# jax raises it as JaxRuntimeError("INTERNAL: herring allreduce on rank R: ...").
_MARKER = "herring allreduce on rank "


class HerringError(jax.errors.JaxRuntimeError):
    """A reduction or the communicator failed at run time.

    Raised when a peer process died, hung or became unreachable (after
    ``HERRING_PEER_TIMEOUT_S`` without a heartbeat, at most
    ``HERRING_TIMEOUT_S``), when processes issued different reductions
    (shapes, dtypes, ops or order), or when the transport could not be
    opened. The message names the ranks, the reduction and what to do.

    It subclasses ``jax.errors.JaxRuntimeError`` (and so ``RuntimeError``):
    a reduction that fails inside a user's jitted function surfaces from jax
    as a JaxRuntimeError, which :func:`herring_errors` and the handler
    :func:`herring_jax.initialize` installs for uncaught exceptions turn into
    this class.
    """


HerringError.__module__ = "herring_jax"  # tracebacks name the public class


def as_herring_error(exc: BaseException) -> BaseException:
    """Returns `exc` as a HerringError if it is a failed herring reduction.

    jax raises a reduction that failed inside a compiled function as
    JaxRuntimeError (when the result is awaited) or ValueError (when the call
    itself ran it). A JaxRuntimeError changes class in place (message,
    traceback and cause kept), so a re-raise of the same object is caught by
    ``except herring_jax.HerringError``; anything else gets a new HerringError
    whose ``__cause__`` is the original. Other exceptions come back unchanged.
    """
    if isinstance(exc, HerringError) or _MARKER not in str(exc):
        return exc
    if type(exc) is jax.errors.JaxRuntimeError:
        exc.__class__ = HerringError
        return exc
    if isinstance(exc, (jax.errors.JaxRuntimeError, ValueError)):
        new = HerringError(str(exc)).with_traceback(exc.__traceback__)
        new.__cause__ = exc
        return new
    return exc


class herring_errors(contextlib.ContextDecorator):
    """Context manager and decorator: failed reductions raise HerringError.

    Inside a user's ``jax.jit`` function, a failed reduction reaches Python as
    jax's ``JaxRuntimeError`` when the step runs or its result is read. Code
    run under ``with herring_jax.herring_errors():`` (or a function decorated
    with ``@herring_jax.herring_errors()``) sees those as ``HerringError``;
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
        return False  # re-raise (re-classed in place where it was a JaxRuntimeError)


_hook_lock = threading.Lock()
_hook_installed = False


def install_excepthook(fast_exit: bool = True) -> None:
    """Makes an uncaught herring failure print as HerringError (idempotent).

    With `fast_exit` (HERRING_FAST_EXIT), the process then ends at once with
    status 1 instead of running its exit handlers: jax.distributed's
    shutdown barrier would otherwise wait up to its heartbeat timeout (about
    100 s) for the dead peer. `herring-jax launch` sees the failure and stops
    the other ranks.
    """
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        previous = sys.excepthook

        def hook(exc_type, exc, tb):
            herring = None if exc is None else as_herring_error(exc)
            if not isinstance(herring, HerringError):
                previous(exc_type, exc, tb)
                return
            previous(HerringError, herring, herring.__traceback__)
            if fast_exit:
                sys.stderr.write("herring_jax: exiting at once after an uncaught HerringError "
                                 "(HERRING_FAST_EXIT=0 runs exit handlers instead)\n")
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:  # noqa: BLE001 - a closed stream must not block the exit
                        pass
                os._exit(1)

        sys.excepthook = hook
        _hook_installed = True
