"""Pick the GPU kernel config for a fused call, or decide the unfused program wins.

Order: explicit `OverlapConfig.kernel` -> measured cache (JSON shipped in
tuning/data/, written from benchmark runs) -> heuristic.  A shape the
kernel cannot run (alignment, dtype, shared memory) is never chosen.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import numpy as np

from jax_autooverlap.tuning.config import KernelConfig, OverlapConfig

_DATA = pathlib.Path(__file__).parent / "data"
SMEM_LIMIT = 227 * 1024
KERNEL_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class Verdict:
  kernel: KernelConfig | None  # None: run the unfused program
  reason: str                  # why (shown by ao.explain)


def cache_key(op: str, device_kind: str, world: int, m: int, k: int, n: int, dtype) -> str:
  return f"{op}|{device_kind}|w{world}|{m}x{k}x{n}|{np.dtype(dtype).name}"


@functools.cache
def _cache() -> dict:
  entries = {}
  for path in sorted(_DATA.glob("*.json")):
    for key, value in json.loads(path.read_text()).items():
      entries[key] = value
  return entries


def default_kernel(dtype) -> KernelConfig:
  if np.dtype(dtype).itemsize == 4:
    return KernelConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3)
  return KernelConfig()


def unsupported(m_shard: int, k: int, n: int, dtype, out_dtype, cfg: KernelConfig) -> str | None:
  """Why the kernel cannot run this shape, or None."""
  dt = np.dtype(dtype)
  if dt.name not in KERNEL_DTYPES:
    return f"dtype {dt.name} has no GPU kernel"
  if (k * dt.itemsize) % 16 or (n * dt.itemsize) % 16 or (n * np.dtype(out_dtype).itemsize) % 16:
    return f"K={k} and N={n} rows must be 16-byte aligned for TMA"
  if k % 64:
    return f"K={k} must be a multiple of 64"
  if cfg.smem_bytes(dt.itemsize, np.dtype(out_dtype).itemsize) > SMEM_LIMIT:
    return f"kernel config needs more than {SMEM_LIMIT} bytes of shared memory"
  return None


def choose_rs(config: OverlapConfig, device_kind: str, world: int, m: int, k: int, n: int,
              dtype, out_dtype) -> Verdict:
  """Kernel config for psum_scatter(a @ b, rows) with per-device a[m, k], b[k, n].

  Only measured wins (or an explicit request) select this kernel: there is no
  heuristic for it yet.
  """
  explicit = config.kernel
  cfg = explicit or default_kernel(dtype)
  why_not = unsupported(m // world, k, n, dtype, out_dtype, cfg)
  if why_not is None and m % world:
    why_not = f"M={m} is not divisible by the axis size {world}"
  if why_not:
    return Verdict(None, why_not)
  if explicit is not None or config.impl == "triton":
    return Verdict(cfg, "explicit config" if explicit else "impl='triton'")
  hit = _cache().get(cache_key("rs", device_kind, world, m, k * world, n, dtype))
  if hit is not None and hit.get("impl") == "triton":
    return Verdict(KernelConfig(**hit["kernel"]), "measured: fused kernel faster")
  if hit is not None:
    return Verdict(None, "measured: unfused faster")
  return Verdict(None, "GEMM+RS kernel not measured for this shape")


def choose_ag(config: OverlapConfig, device_kind: str, world: int, m_shard: int, k: int, n: int,
              dtype, out_dtype) -> Verdict:
  """Kernel config for all_gather(rows) @ b with per-device shapes a[m_shard, k], b[k, n]."""
  explicit = config.kernel
  cfg = explicit or default_kernel(dtype)
  why_not = unsupported(m_shard, k, n, dtype, out_dtype, cfg)
  if why_not:
    return Verdict(None, why_not)
  if explicit is not None or config.impl == "triton":
    return Verdict(cfg, "explicit config" if explicit else "impl='triton'")
  hit = _cache().get(cache_key("ag", device_kind, world, m_shard * world, k, n * world, dtype))
  if hit is not None:
    if hit.get("impl") != "triton":
      return Verdict(None, f"measured: unfused faster ({hit.get('note', '')})".rstrip(" ()"))
    return Verdict(KernelConfig(**hit["kernel"]), "measured: fused kernel faster")
  # Heuristic until measured: overlap pays when the GEMM is large enough to
  # hide the transfer and to amortise the kernel's fixed cost.
  if m_shard * world < 4096 or k < 2048 or n < 1024:
    return Verdict(None, "heuristic: too small to gain from overlap")
  return Verdict(cfg, "heuristic: large GEMM")
