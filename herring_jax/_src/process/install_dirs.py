"""Where the libraries' code is installed, so that a message can name the
user's own code: the stall and mismatch lines name the user's call site, and
an uncaught HerringError prints the user's frames. Both skip the frames of
herring_jax, jax, jaxlib, optax, flax and orbax, found by where those are
installed, not by their names: a user's directory called herring_jax (a clone
of this repository, say) holds the user's code, and so do the examples shipped
inside the installed package."""

from __future__ import annotations

import functools
import importlib.util
import os

# The libraries that stand between a user's program and a reduction.
LIBRARIES = ("jax", "jaxlib", "optax", "flax", "orbax")

# .../herring_jax/_src/process/install_dirs.py -> .../herring_jax
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_EXAMPLES_DIR = os.path.join(_PACKAGE_DIR, "examples") + os.sep


@functools.lru_cache(maxsize=None)
def library_dirs() -> tuple[str, ...]:
    """The install directories of herring_jax and of LIBRARIES (those that
    are installed), each ending in a separator."""
    dirs = [_PACKAGE_DIR]
    for name in LIBRARIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(spec.submodule_search_locations)
    return tuple(os.path.abspath(d) + os.sep for d in dirs)


def in_library(file_name: str) -> bool:
    """Whether `file_name` is the code of an installed library rather than
    of the user's program (the shipped examples are a program's own code)."""
    path = os.path.abspath(file_name)
    return path.startswith(library_dirs()) and not path.startswith(_EXAMPLES_DIR)
