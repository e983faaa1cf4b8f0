#!/usr/bin/env bash
# The test command: installs what is missing, builds herring_jax, runs the suite
# (real multi-process jobs on this machine). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install.sh
# -P: the source tree's herring_jax (no compiled extension) must not shadow
# the installed package.
exec python3 -P -m pytest tests -q -rfEs --durations=10 "$@"
