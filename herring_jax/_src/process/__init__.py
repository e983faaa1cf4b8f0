"""The process runtime, at the bottom: knobs, errors, the jax version shim, start-up and shutdown
of the C++ engine, the topology and device layout, the timeline, the summation servers and exit
statuses. Imports nothing else of herring_jax.
"""
