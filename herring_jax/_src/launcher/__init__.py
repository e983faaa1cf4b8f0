"""The launcher: `herring-jax launch` and its restarts, and the simulated hosts of --netns. Imports
only the process runtime, never jax.
"""
