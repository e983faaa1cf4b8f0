"""The documentation site: `bash docs/build.sh` builds it with warnings as
errors and runs the docstrings' examples, the API page lists every public
name, and the knob table of its knobs page is the one the code declares."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

import herring_jax
from herring_jax._src.process import knobs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_knob_table_is_current():
    page = (ROOT / "docs" / "guides" / "knobs.md").read_text()
    table = knobs.markdown_table()
    assert table in page, (
        "docs/guides/knobs.md's table differs from herring_jax/_src/process/knobs.py; paste the "
        "output of `python3 -P -c 'from herring_jax._src.process import knobs; "
        "print(knobs.markdown_table())'` over it")


def test_docs_build_without_warnings_and_run_the_docstring_examples():
    if importlib.util.find_spec("sphinx") is None:
        if os.environ.get("CI"):
            pytest.fail("sphinx is missing: .ci/install.sh installs it")
        pytest.skip("sphinx is not installed here (.ci/install.sh installs it)")
    # The interpreter running the tests is the one herring_jax is installed for.
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable),
                                                 os.environ["PATH"]]))
    proc = subprocess.run(["bash", str(ROOT / "docs" / "build.sh")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doctest = (ROOT / "build" / "docs" / "doctest" / "output.txt").read_text()
    ran = int(re.search(r"(\d+) tests?\n\s+0 failures in tests", doctest).group(1))
    assert ran >= 4, doctest  # the examples that need no job of several processes
    api = (ROOT / "build" / "docs" / "html" / "api.html").read_text()
    missing = [n for n in herring_jax.__all__ if f'id="herring_jax.{n}"' not in api]
    assert not missing, f"the API reference lacks {missing}"
