"""herring_jax's tools, apart from the library: the benchmark (`herring-jax
bench`), the training bench (`herring-jax train-bench`) with its workers and
plots, and the simulated network of `herring-jax launch --netns`.

The library's modules import nothing from here at import time; only the
command line (herring_jax._src.cli, which dispatches to these commands) and
`herring-jax launch --netns` reach in, when they are asked to.
tests/test_tools.py checks both.
"""
