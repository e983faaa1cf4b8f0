"""The launcher: `herring-jax launch` and its restarts, the simulated hosts of --netns, and the
server-only processes (`herring-jax serve`, serving.py). Imports only the process floor's modules
that do without jax, never jax.
"""
