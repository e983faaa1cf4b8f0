"""The libfabric variables herring_jax sets, set once at import.

libfabric reads its FI_* variables from the environment when the provider
starts (the process's first fi_getinfo, in initialize()). Setting them there,
from C++, meant setenv while jax.distributed's and XLA's threads may read the
environment: glibc's setenv is not safe against a concurrent getenv. At
``import herring_jax`` no such thread runs yet (jax starts them with its
backend or jax.distributed), so they are set here. A value the user set wins.
"""

from __future__ import annotations

import ipaddress
import os

from herring_jax._src.process import knobs

# libfabric's psm provider links libinfinipath, whose constructor (run as
# the extension loads) replaces the handlers of SIGINT, SIGTERM, SIGSEGV,
# SIGBUS, SIGILL and SIGABRT with one that calls exit(1) (after writing a
# backtrace file to the working directory for the last four): Ctrl-C then
# ended a process with status 1 and no KeyboardInterrupt, a crash left a
# .btr file instead of Python's report. This variable turns that off; it is
# read only by that constructor, so it must be set before the import.
os.environ.setdefault("IPATH_NO_BACKTRACE", "1")

try:
    from herring_jax import _herring_ffi
except ImportError:
    # Raised while `import herring_jax` runs (this is the first import of
    # it), where Python's own words would be "a circular import".
    raise ImportError(
        "herring_jax's compiled extension (_herring_ffi) is missing. Install the package "
        "with `pip install --no-build-isolation .` (it needs libfabric-dev and pkg-config; "
        "`bash .ci/install.sh` installs everything). If it is installed, a source checkout "
        "of herring_jax in the current directory shadows it: run from another directory, "
        "or with `python -P`.") from None

# Bytes of herring's wire header in front of every chunk (engine/wire.h).
WIRE_HEADER_BYTES = _herring_ffi.WIRE_HEADER_BYTES
# The variables herring_jax set and their values (VAR=value;...), so that a
# child process recomputes them from its own knobs instead of taking them for
# the user's.
_MARKER = "HERRING_FI_VARS_SET"


def _is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def prepare() -> dict[str, str]:
    """Sets the variables the user left unset; returns what it set."""
    wanted = {
        # ofi_rxm sends messages above its eager limit by rendezvous, whose read
        # requests queue behind bulk sends on a connection busy both ways (each
        # direction got half the link): send every chunk eagerly.
        "FI_OFI_RXM_EAGER_LIMIT": str(knobs.get("HERRING_CHUNK_BYTES") + WIRE_HEADER_BYTES),
    }
    iface = knobs.get("HERRING_FI_IFACE")
    if iface and not _is_ip_address(iface):
        # An interface name reaches the IP providers through their own
        # variables (an address goes to fi_getinfo as the node instead).
        for var in ("FI_TCP_IFACE", "FI_SOCKETS_IFACE", "FI_UDP_IFACE"):
            wanted[var] = iface
    # Variables herring_jax set (in this process, or in a parent that imported
    # it and passed its environment on) are herring's to recompute while they
    # still hold the value it put there; any other value is the user's.
    ours = dict(item.split("=", 1) for item in (knobs.get(_MARKER) or "").split(";") if item)
    ours = {k: v for k, v in ours.items() if os.environ.get(k) == v}
    done = {}
    for var, value in wanted.items():
        if var not in os.environ or var in ours:
            os.environ[var] = value
            done[var] = value
            ours[var] = value
    for var in [v for v in ours if v not in wanted]:  # e.g. HERRING_FI_IFACE unset since
        os.environ.pop(var, None)
        del ours[var]
    os.environ[_MARKER] = ";".join(f"{k}={v}" for k, v in sorted(ours.items()))
    return done
