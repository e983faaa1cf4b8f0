"""pytest set-up: tests run against the installed herring_jax (see tests/run.sh)."""

import os

# One CPU device per test process unless a test asks for more; the workers
# get their device count from the launcher.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
