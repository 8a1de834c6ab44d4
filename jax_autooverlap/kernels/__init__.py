"""Pure Triton kernels (no JAX imports); called only from backends/triton.py."""
