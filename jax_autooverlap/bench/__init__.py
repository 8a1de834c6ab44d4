"""Benchmarks (programs, not tests): `python -m jax_autooverlap.bench ag`."""
