"""Tuning: configs of the fused ops and how they are chosen."""
from jax_autooverlap.tuning.config import OverlapConfig, resolve_chunks

__all__ = ["OverlapConfig", "resolve_chunks"]
