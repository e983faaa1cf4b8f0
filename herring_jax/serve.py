"""`python -m herring_jax.serve --coordinator HOST:PORT [--index J]`

Runs a server-only process of a herring_jax job (the same as `herring-jax
serve`); see herring_jax._src.launcher.serving and docs/guides/servers.md.
"""

from herring_jax._src.launcher.serving import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
