"""`python -m herring_jax.launch -n N [--devices-per-process D] -- CMD ...`"""

from herring_jax._src.launch import main as main

if __name__ == "__main__":
    raise SystemExit(main())
