"""Fused collective matmuls: public ops, their references and their VJPs."""
from jax_autooverlap.ops.api import ag_matmul, matmul_rs

__all__ = ["ag_matmul", "matmul_rs"]
