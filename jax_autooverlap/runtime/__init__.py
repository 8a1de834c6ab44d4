"""Runtime of the GPU kernels: symmetric workspaces, CUDA driver access, error reporting."""
from jax_autooverlap.runtime.errors import CollectiveTimeoutError, check_errors

__all__ = ["CollectiveTimeoutError", "check_errors"]
