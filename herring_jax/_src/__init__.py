"""Implementation of herring_jax. Everything here is private; import from herring_jax."""
