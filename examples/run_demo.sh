#!/usr/bin/env bash
# The main job: installs what is missing, builds herring_jax, then runs a
# 4-process reduction on this machine and checks every rank against numpy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install.sh
cd examples  # run the installed herring_jax, not the source tree
exec timeout -k 5 600 herring-jax launch -n "${HERRING_DEMO_PROCESSES:-4}" -- \
  python3 demo_allreduce.py
