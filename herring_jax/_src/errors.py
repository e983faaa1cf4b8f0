"""Exception types raised by herring_jax."""


class HerringError(RuntimeError):
    """A reduction or the communicator failed at run time.

    Raised when a peer process died or hung past ``HERRING_TIMEOUT_S``, when
    processes issued different reductions (shapes, dtypes, ops or order), or
    when the transport could not be opened. The message names the rank and
    what to do.
    """
