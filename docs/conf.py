"""Sphinx configuration of herring_jax's documentation (bash docs/build.sh).

autodoc imports the installed herring_jax (with its compiled extension), not
the source tree: build after `pip install --no-build-isolation .`, as
.ci/install.sh does. The API page lists herring_jax.__all__, written out here
at every build, so that a new public name cannot be missed.
"""

from __future__ import annotations

import inspect
import os

import herring_jax

project = "herring_jax"
author = "the herring_jax authors"
copyright = "2026, the herring_jax authors"
release = herring_jax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings are Google style, like optax's
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_generated"]  # included by api.md, not pages of their own
suppress_warnings = []

html_theme = "sphinx_book_theme"  # what optax and flax use; no network needed to build
html_title = f"herring_jax {release}"
html_theme_options = {"show_toc_level": 2, "use_download_button": False}

autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# The docstrings' examples run in the doctest builder; those that need a job
# of several processes carry `# doctest: +SKIP`.
doctest_global_setup = """
import jax
import jax.numpy as jnp
import numpy as np
import optax
import herring_jax
"""


# What each public constant means (a KeyError here: describe the new one).
_CONSTANTS = {
    "PREEMPTED_EXIT_CODE": "The exit status of a process that saved for a preemption "
                           "(``preemption_requested()`` returned True) and stopped: 75, "
                           "``EX_TEMPFAIL``, neither success nor failure. ``herring-jax "
                           "launch`` exits with it too and does not restart such a run "
                           "(the Failures guide, Restarts and preemption).",
}


def _write_api_list() -> None:
    """_generated/api_list.md: one autodoc entry per name in herring_jax.__all__
    (in eval-rst: autodoc writes reST, which MyST would read as Markdown)."""
    lines = ["```{eval-rst}"]
    for name in herring_jax.__all__:
        obj = getattr(herring_jax, name)  # the package loads its names lazily
        if not callable(obj):
            # A constant: autodoc cannot reach the comment at its definition
            # through the package's lazy names.
            # (automodule above has made herring_jax the current module)
            lines += [f".. py:data:: {name}", f"   :value: {obj!r}", "",
                      f"   {_CONSTANTS[name]}", ""]
            continue
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            directive = "autoexception"
        elif inspect.isclass(obj) and not hasattr(obj, "__enter__"):
            directive = "autoclass"
        else:
            directive = "autofunction"
        lines += [f".. {directive}:: herring_jax.{name}", ""]
    out = os.path.join(os.path.dirname(__file__), "_generated", "api_list.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    text = "\n".join(lines + ["```", ""])
    if not os.path.exists(out) or open(out).read() != text:  # unchanged: no rebuild
        with open(out, "w") as f:
            f.write(text)


_write_api_list()
