#!/usr/bin/env bash
# Builds the documentation site into build/docs/html (ignored by git) with
# every warning an error, then runs the docstrings' examples (Sphinx's
# doctest builder; those marked `# doctest: +SKIP` need a job of several
# processes and do not run). Needs what .ci/install.sh installs (sphinx,
# myst-parser, sphinx-book-theme) and herring_jax installed for python3:
# autodoc imports the installed package.
#
#   bash docs/build.sh          # then open build/docs/html/index.html
set -euo pipefail
cd "$(dirname "$0")/.."
# -P: the source tree's herring_jax (no compiled extension) must not shadow
# the installed package.
python3 -P -m sphinx -W --keep-going -q -b html -d build/docs/doctrees docs build/docs/html
python3 -P -m sphinx -W --keep-going -q -b doctest -d build/docs/doctrees docs build/docs/doctest
echo "docs: build/docs/html/index.html"
