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
# Two tests at a time (pytest-xdist): most of a multi-process test's time is
# its processes starting, compiling and waiting on each other, and one test
# at a time left a third of the 2 cores idle (18.6 min serial on a quiet
# machine, 2026-11-28). Each test must pass beside another anyway (the suite
# runs beside a CPU hog); `-n 0` after the command runs one at a time.
exec python3 -P -m pytest tests -q -rfEs --durations=30 -n 2 --dist loadgroup \
  -m "not extended" "$@"
