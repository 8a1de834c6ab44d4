"""jax_autooverlap: compute-communication overlap for collective matmuls in JAX."""
from jax_autooverlap.api import AutoOverlapJit, explain, jit
from jax_autooverlap.ops import ag_matmul, matmul_rs
from jax_autooverlap.rewrite import Match, Report
from jax_autooverlap.tuning.config import KernelConfig, OverlapConfig

__all__ = ["jit", "explain", "AutoOverlapJit", "ag_matmul", "matmul_rs", "OverlapConfig",
           "KernelConfig", "Match", "Report"]
__version__ = "0.1.0"
