"""Backends: the one call site of the Triton kernels (jax-triton) and their host-side set-up."""
