"""`python -m herring_jax.bench -n 4 [--sizes-mib ...]`: herring_jax against its peers."""

from herring_jax._src.tools.bench import main as main

if __name__ == "__main__":
    raise SystemExit(main())
