"""Pure Triton and Gluon kernels (no JAX imports); launched only from backends/ (the loopback
benchmark's set-up kernel from bench/loopback.py)."""
