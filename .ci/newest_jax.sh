#!/usr/bin/env bash
# The suite's second setup: Python 3.12 with the newest jax herring_jax
# supports (0.12.x), beside the README's command on python3 (3.11, jax 0.10).
# Makes its own venv, $HERRING_PY312_VENV or else build/venv-py3.12 (kept
# between runs: pip then installs only what is missing; .ci/run keeps it
# under ~/.cache, where a new clone finds it), installs into it what .ci/install.sh installs for
# 3.12, builds herring_jax there, and runs the tests below: about 5 min on 2
# cores (2 to make the venv and build, 3 of tests), measured with a new venv
# and pip's cache warm.
#
#   bash .ci/newest_jax.sh                       # as .ci/run runs it
#   bash .ci/newest_jax.sh tests/test_compat.py  # other pytest arguments instead
#   bash .ci/newest_jax.sh tests                 # the whole suite
#
# The interpreter: $PYTHON312 if set, else python3.12 on PATH, else the
# newest 3.12 that pyenv holds. Neither Debian 12 nor its backports carry
# 3.12, so a machine without one fails here, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
  local candidate
  for candidate in ${PYTHON312:-} python3.12 $(ls -d "$HOME"/.pyenv/versions/3.12.*/bin/python3.12 \
      2>/dev/null | sort -V -r); do
    # pyenv's shim answers to python3.12 on PATH even where it cannot run it.
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

if ! py312=$(find_python312); then
  echo "newest_jax.sh: error: no Python 3.12 found (tried \$PYTHON312, python3.12 on PATH and" \
    "~/.pyenv/versions/3.12.*); install one (e.g. pyenv install 3.12) or set PYTHON312" >&2
  exit 1
fi

venv=${HERRING_PY312_VENV:-build/venv-py3.12}
# A venv whose interpreter is gone (pyenv's 3.12 replaced) is made again.
if [ -d "$venv" ] && ! "$venv/bin/python3" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' \
    2>/dev/null; then
  echo "== $venv does not run Python 3.12: making it again"
  rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python3" ]; then
  echo "== creating $venv with $py312"
  mkdir -p "$(dirname "$venv")"
  "$py312" -m venv "$venv"
fi
venv=$(cd "$venv" && pwd)
# install.sh and the tests run the venv's python3 (and herring-jax).
export PATH="$venv/bin:$PATH"
bash .ci/install.sh

# Not the whole suite: a second full run would take CI past its budget of
# about 30 min. What runs here is what touches jax's API, once per kind: every
# private jax name in jax_compat.py (varying/unreduced types, lax's checks,
# vmap's named batching, the jit trace's equation order that splits buckets,
# the lowering contexts, the distributed client), the custom call's lowering
# for CPU and CUDA, XLA's run ids that identify reductions, errors as they
# come back through jaxlib, and flax/optax of this jax; on one layout (2
# processes x 2 devices) where the 3.11 suite runs three that differ only in
# how many processes carry the devices. Left out, as they reach jax only
# through the same primitive: the engine, transport, host-stage, peer-failure,
# launcher, netns, codec, soak, chaos, fuzz, C++ unit, bench and train-bench
# tests; `bash .ci/newest_jax.sh tests` runs them all here (the whole suite passed
# so on 2026-11-26 with jax 0.12.0.1, once test_bench expected no torch on 3.12).
tests=(
  tests/test_compat.py         # psum/pmean against lax, vmap, grad, unreduced, no_collectives
  --deselect "tests/test_compat.py::test_lax_compatibility[1-4]"
  --deselect "tests/test_compat.py::test_lax_compatibility[4-1]"
  "tests/test_collectives.py::test_lax_compatibility_and_process_collectives[2-2]"
  "tests/test_fsdp_recipe.py::test_shard_map_fsdp_recipe_runs_with_herring_as_with_lax[2-2]"
  tests/test_lax_vmap.py       # vmap's batch_jaxpr2, the composite's backward pass, reduced types
  "tests/test_allreduce.py::test_every_dtype_op_and_size[2-2]"
  "tests/test_groupings.py::test_interleaved_groupings_match_lax[2-2]"
  tests/test_topk.py           # psum over a mesh axis inside a transform
  tests/test_local_sum.py      # jax's reduce-scatter and all-gather lowering rules (jax_compat)
  tests/test_powersgd.py
  "tests/test_optax.py::test_training_matches_lax_pmean_on_every_process[2-None]"
  "tests/test_optax.py::test_buckets_follow_the_backward_pass_not_pytree_order"
  "tests/test_optax.py::test_allreduce_gradients_is_an_optax_transformation"
  "tests/test_overlap.py::test_reductions_overlap_the_backward_pass[2]"
  "tests/test_state.py::test_broadcast_and_batchnorm_state[2-2]"
  "tests/test_sharded.py::test_inside_shard_map_each_device_keeps_a_quarter"
  "tests/test_examples.py::test_lm_loss_falls_with_two_devices_per_process"
  "tests/test_examples.py::test_quickstart_learns"
  tests/test_nnx.py            # Flax NNX's nnx.Optimizer and nnx.jit of this flax and jax
  tests/test_streaming.py      # the async pair's jax effect (jax_compat), across executions
  "tests/test_identity.py::test_concurrent_and_inlined_reductions_are_exact[2-2]"
  tests/test_errors.py         # HerringError through jaxlib's runtime errors
  "tests/test_failures.py::test_every_way_a_failure_reaches_the_program_raises_herring_error"
  tests/test_cuda_lowering.py  # jax lowers the CUDA handlers on this CPU machine
  tests/test_build.py
  tests/test_install_script.py
)
(($# > 0)) && tests=("$@")
echo "== the suite's Python 3.12 part: $(python3 -c 'import jax, sys; print("Python", sys.version.split()[0], "jax", jax.__version__)')"
# Two tests at a time, as tests/run.sh: one at a time left the 2 cores idle
# while a test's processes started and waited on each other.
python3 -P -m pytest "${tests[@]}" -q -rfEs --durations=10 -n 2 --dist loadgroup
