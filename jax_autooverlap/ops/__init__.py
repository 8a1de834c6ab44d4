"""Fused collective matmuls: one module per op (its reference, VJP, implementations)."""
from jax_autooverlap.ops.ag_matmul import ag_matmul
from jax_autooverlap.ops.matmul_rs import matmul_rs

__all__ = ["ag_matmul", "matmul_rs"]
