"""herring_jax's tools, apart from the library: the benchmark (`herring-jax
bench`), the training bench (`herring-jax train-bench`) with its workers and
plots.

The library's subpackages import nothing from here; only the command line
(herring_jax._src.cli, which dispatches to these commands) does.
tests/test_layout.py checks it.
"""
