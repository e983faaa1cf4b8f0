#!/usr/bin/env bash
# The main job: installs what is missing and builds herring_jax, then trains a
# Flax model data-parallel on 4 local processes (HERRING_DEMO_PROCESSES), checks
# the parameters against one process's training and bitwise across the
# processes, and writes the loss curve to build/demo_loss.png. Arguments go to
# examples/demo_train.py (--steps, --plot PATH, ...); HERRING_DEMO_INSTALL=0
# skips the installs (the test of this script does).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${HERRING_DEMO_INSTALL:-1}" != 0 ]; then
  bash .ci/install.sh demo
fi
mkdir -p build
plot="$PWD/build/demo_loss.png"
cd examples  # run the installed herring_jax, not the source tree
exec timeout -k 5 600 herring-jax launch -n "${HERRING_DEMO_PROCESSES:-4}" -- \
  python3 demo_train.py --plot "$plot" "$@"
