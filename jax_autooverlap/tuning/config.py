"""Frozen, self-validating configuration of the fused ops.

Choice order (documented once, used by ops): explicit config -> tuning cache ->
heuristic.  Only the explicit and heuristic steps exist until the GPU kernels
land; the cache/autotune steps plug in here.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

Impl = Literal["auto", "reference", "unfused"]
IMPLS: tuple[str, ...] = ("auto", "reference", "unfused")

DEFAULT_CHUNKS = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlapConfig:
  """How a fused op runs.

  impl: "auto" lets the dispatcher pick per platform (reference ring on
    CPU/TPU; on GPUs the unfused program until a kernel beats it),
    "reference" forces the chunked ppermute ring, "unfused" forces the plain
    all_gather/psum_scatter + dot_general program.
  chunks: pieces each shard is split into for communication (>= 1); None
    lets the tuner choose.
  """
  impl: Impl = "auto"
  chunks: int | None = None

  def __post_init__(self):
    if self.impl not in IMPLS:
      raise ValueError(f"OverlapConfig: impl={self.impl!r} is not one of {IMPLS}")
    if self.chunks is not None and (
        not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1):
      raise ValueError(f"OverlapConfig: chunks={self.chunks!r} must be a positive int or None")


def resolve_chunks(config: OverlapConfig, rows: int) -> int:
  """Chunk count actually used for a shard of `rows` rows (never more than rows)."""
  chunks = DEFAULT_CHUNKS if config.chunks is None else config.chunks
  return max(1, min(chunks, rows))
