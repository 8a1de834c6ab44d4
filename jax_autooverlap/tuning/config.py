"""Frozen, self-validating configuration of the fused ops.

Choice order (tuning/select.py): explicit config -> tuning cache (measured
verdicts: the user's first-call measurements and benchmark runs, shipped JSON)
-> first-call measurement (on by default) -> cost model (tuning/model.py) ->
unfused.  The cache says, per device kind, world size, shape and dtype, whether
the fused GPU kernel beat the unfused program and with which kernel config.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal

Impl = Literal["auto", "reference", "unfused", "triton"]
IMPLS: tuple[str, ...] = ("auto", "reference", "unfused", "triton")

DEFAULT_CHUNKS = 1

# GPU kernel engines: "tl" the portable Triton kernels (kernels/ag_gemm.py, gemm_rs.py), "gluon"
# the warp-specialised Gluon kernels for sm_90 (kernels/gluon_*.py).  The tuner picks by measurement.
ENGINES: tuple[str, ...] = ("tl", "gluon")

# JAX_AUTOOVERLAP_AUTOTUNE=0 (or false, no, off) turns first-call measurement off in every call.
AUTOTUNE_ENV = "JAX_AUTOOVERLAP_AUTOTUNE"
_OFF = ("0", "false", "no", "off")


def _positive_int(owner: str, name: str, value, allow_none=False):
  if value is None and allow_none:
    return
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{owner}: {name}={value!r} must be a positive int"
                     + (" or None" if allow_none else ""))


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
  """Tiles, pipelining and communication split of the fused GPU kernels."""
  block_m: int = 128
  block_n: int = 256
  block_k: int = 64
  group_m: int = 8
  num_warps: int = 8
  num_stages: int = 3
  chunks: int = 4      # communication chunks per shard (arrival granularity)
  num_comm: int = 8    # CTAs that move data (the rest compute)
  engine: str = "tl"   # one of ENGINES
  # GEMM+RS on the Gluon engine with a consumer partition per warpgroup (kernels/gluon_gemm_rs.py
  # WG_PARTS = 2; measured 0.5-1.1 % faster in loopback, docs/NOTES.md).  Autotuning times GEMM+RS
  # with and without it; every rank of a group must use the same.  AG+GEMM ignores it; the
  # engine's GEMM alone (backends/gluon.launch_gemm) refuses it.
  wg_partitions: bool = False
  # Split-K (`tl` engine): each output tile's k-blocks in split_k parts, computed by different
  # CTAs; the last part to finish sums them in a fixed order and finishes the tile
  # (kernels/split_k.py).  For shapes with fewer tiles than SMs; at most
  # runtime.workspace.MAX_CHUNKS tiles per call (tuning/select.py split_k_unsupported).
  split_k: int = 1
  # With split_k > 1: split only the call's last split_tail tiles (0: every tile), for shapes
  # whose last wave of tiles would leave most SMs idle (tuning/select.py tail_split_config).
  split_tail: int = 0
  # AG+GEMM on `tl` where a shard has fewer rows than a tile: each row tile holds the shards of
  # block_m / shard rows sources (kernels/ag_gemm.py PACK), so B is read once per that many
  # sources, not once per source (tuning/select.py unsupported says which shapes take it).
  pack_shards: bool = False

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if f.name not in ("engine", "wg_partitions", "split_tail", "pack_shards"):
        _positive_int("KernelConfig", f.name, getattr(self, f.name))
    tail = self.split_tail
    if not isinstance(tail, int) or isinstance(tail, bool) or tail < 0:
      raise ValueError(f"KernelConfig: split_tail={tail!r} must be an int >= 0")
    if tail and self.split_k == 1:
      raise ValueError(f"KernelConfig: split_tail={tail} needs split_k > 1")
    if not isinstance(self.wg_partitions, bool):
      raise ValueError(f"KernelConfig: wg_partitions={self.wg_partitions!r} must be a bool")
    if self.wg_partitions and (self.engine != "gluon" or self.block_m != 128):
      raise ValueError(f"KernelConfig: wg_partitions=True needs engine='gluon' and block_m=128 "
                       f"(engine={self.engine!r}, block_m={self.block_m})")
    if not isinstance(self.pack_shards, bool):
      raise ValueError(f"KernelConfig: pack_shards={self.pack_shards!r} must be a bool")
    if self.pack_shards and self.engine != "tl":
      raise ValueError(f"KernelConfig: pack_shards=True needs engine='tl' "
                       f"(engine={self.engine!r})")
    if self.split_k > 1 and self.engine != "tl":
      raise ValueError(f"KernelConfig: split_k={self.split_k} needs engine='tl' "
                       f"(engine={self.engine!r})")
    if self.engine not in ENGINES:
      raise ValueError(f"KernelConfig: engine={self.engine!r} is not one of {ENGINES}")
    for f in ("block_m", "block_n", "block_k"):
      v = getattr(self, f)
      if v & (v - 1) or v < 16:
        raise ValueError(f"KernelConfig: {f}={v} must be a power of two >= 16")
    if self.num_warps not in (4, 8):
      raise ValueError(f"KernelConfig: num_warps={self.num_warps} must be 4 or 8")
    if self.engine == "gluon":
      # a consumer warpgroup (4 warps) per 64 rows: 128-row tiles with two, 64-row tiles with
      # one; one wgmma is at most 256 columns wide; the producer needs a second stage to fill
      # while the consumers read the first
      need = {"block_m": (self.block_m in (64, 128), "64 or 128"),
              "block_n": (self.block_n <= 256, "<= 256"),
              "num_warps": (self.num_warps == self.block_m // 16, "block_m / 16"),
              "num_stages": (self.num_stages >= 2, ">= 2")}
      for name, (ok, want) in need.items():
        if not ok:
          raise ValueError(f"KernelConfig: {name}={getattr(self, name)} must be {want} for "
                           "engine='gluon'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlapConfig:
  """How a fused op runs.

  impl: "auto" lets the dispatcher pick (reference ring on CPU/TPU; on
    NVIDIA GPUs the Triton kernel where the tuner says it beats the unfused
    program, else the unfused program), "reference" forces the chunked
    ppermute ring, "unfused" the plain collective + dot_general program,
    "triton" the GPU kernel.  Where the kernel cannot run (no NVIDIA GPU, a
    shape, dtype or form it does not cover, a group spanning hosts) a direct
    `ag_matmul` / `matmul_rs` call raises ValueError saying why, and `ao.jit`
    leaves that match as written: the plain collective and matmul run, and
    `ao.explain` lists the row as skipped with the reason.
  chunks: pieces each shard is split into by the reference ring (>= 1).
  kernel: explicit GPU kernel config (else the tuner's).
  timeout_s: bound on every cross-GPU wait of the kernels.
  autotune: on the first trace of a shape with no measured verdict for its GPU
    kind, group size and dtype, time the kernel candidates against the unfused
    program on the call's GPUs, every process of the mesh agreeing, and keep
    the verdict in the user's tuning cache (tuning/autotune.py).  On by
    default; False keeps the cost model's choice where it was fit for this GPU
    kind and group size, else the unfused program.  JAX_AUTOOVERLAP_AUTOTUNE=0
    turns it off in every call.
  """
  impl: Impl = "auto"
  chunks: int | None = None
  kernel: KernelConfig | None = None
  timeout_s: float = 10.0
  autotune: bool = True

  def __post_init__(self):
    if self.impl not in IMPLS:
      raise ValueError(f"OverlapConfig: impl={self.impl!r} is not one of {IMPLS}")
    _positive_int("OverlapConfig", "chunks", self.chunks, allow_none=True)
    if self.kernel is not None and not isinstance(self.kernel, KernelConfig):
      raise TypeError(f"OverlapConfig: kernel must be a KernelConfig, got {type(self.kernel).__name__}")
    if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s <= 3600):
      raise ValueError(f"OverlapConfig: timeout_s={self.timeout_s!r} must be in (0, 3600]")
    if not isinstance(self.autotune, bool):
      raise TypeError(f"OverlapConfig: autotune={self.autotune!r} must be a bool")


def autotune_enabled(config: OverlapConfig) -> bool:
  """First-call measurement asked for: the config's `autotune`, unless the environment turns
  it off everywhere."""
  return config.autotune and os.environ.get(AUTOTUNE_ENV, "").strip().lower() not in _OFF


def as_overlap_config(config, what: str) -> OverlapConfig:
  """`config` checked to be an OverlapConfig (None: the default); `what` names the argument
  ("ao.jit: overlap_config")."""
  if config is None:
    return OverlapConfig()
  if isinstance(config, OverlapConfig):
    return config
  hint = (f"ao.OverlapConfig(**{config!r})" if isinstance(config, dict)
          else "ao.OverlapConfig(impl=..., chunks=...)")
  raise TypeError(f"{what} must be an ao.OverlapConfig, got "
                  f"{type(config).__name__}; pass {hint}")


def resolve_chunks(config: OverlapConfig, rows: int) -> int:
  """Chunk count the reference ring uses for a shard of `rows` rows (never more than rows)."""
  chunks = DEFAULT_CHUNKS if config.chunks is None else config.chunks
  return max(1, min(chunks, rows))
