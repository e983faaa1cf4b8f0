#!/usr/bin/env bash
# The test command: installs what is missing, builds herring_jax, runs the suite
# (real multi-process jobs on this machine) but its extended part (the tools'
# and the long-haul tests, tests/conftest.py's EXTENDED), which .ci/run runs
# after it. Extra arguments go to pytest: `-m extended` runs the extended part
# instead, `-m ""` everything.
set -euo pipefail
cd "$(dirname "$0")/.."
# What the core tier needs; the extended part (`-m extended`, or `-m ""` for
# everything) also needs the benchmark's peers.
purpose=tests
for arg in "$@"; do
  case "$arg" in *extended*|"") purpose=all ;; esac
done
bash .ci/install.sh "$purpose"
# -P: the source tree's herring_jax (no compiled extension) must not shadow
# the installed package.
exec python3 -P -m pytest tests -q -rfEs --durations=30 -m "not extended" "$@"
