"""`python -m herring_jax.launch -n N [--devices-per-process D] -- CMD ...`

Starts N local processes of CMD for herring_jax; see herring_jax._src.launcher.launch
for the options, the environment each process gets and the exit codes.
"""

from herring_jax._src.launcher.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
