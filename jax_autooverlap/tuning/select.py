"""Pick the GPU kernel config for a fused call, or decide the unfused program wins.

Order: explicit `OverlapConfig.kernel` -> measured cache -> heuristic.  The
cache is the JSON shipped in tuning/data/ plus the user's cache directory
(`user_cache_dir()`, where `python -m jax_autooverlap.bench` records its
verdicts; user entries win).  A shape the kernel cannot run (alignment,
dtype, shared memory) is never chosen, and no heuristic picks the kernel on
a (GPU kind, group size) where it has never been measured: there it has not
been checked against the unfused program.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
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


def user_cache_dir() -> pathlib.Path:
  """Where benchmark runs record measured verdicts ($JAX_AUTOOVERLAP_CACHE_DIR or ~/.cache)."""
  env = os.environ.get("JAX_AUTOOVERLAP_CACHE_DIR")
  return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "jax_autooverlap"


@functools.cache
def _cache() -> dict:
  """Shipped entries, then the user's (read once per process)."""
  entries = {}
  for path in sorted(_DATA.glob("*.json")) + sorted(user_cache_dir().glob("tuning-*.json")):
    entries.update(json.loads(path.read_text()))
  return entries


def _measured_here(op: str, device_kind: str, world: int) -> bool:
  prefix = f"{op}|{device_kind}|w{world}|"
  return any(key.startswith(prefix) for key in _cache())


def default_kernel(dtype) -> KernelConfig:
  """The config where no measurement names one.  Its engine is $JAX_AUTOOVERLAP_ENGINE if set
  (e.g. `gluon`: run the GPU tests on that engine), else "tl"; float32 always runs "tl"."""
  if np.dtype(dtype).itemsize == 4:
    return KernelConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3)
  return KernelConfig(engine=os.environ.get("JAX_AUTOOVERLAP_ENGINE", "tl"))


def unsupported(m_shard: int, k: int, n: int, dtype, out_dtype, cfg: KernelConfig) -> str | None:
  """Why the kernel cannot run this shape, or None."""
  dt = np.dtype(dtype)
  if dt.name not in KERNEL_DTYPES:
    return f"dtype {dt.name} has no GPU kernel"
  if (k * dt.itemsize) % 16 or (n * dt.itemsize) % 16 or (n * np.dtype(out_dtype).itemsize) % 16:
    return f"K={k} and N={n} rows must be 16-byte aligned for TMA"
  if k % 64:
    return f"K={k} must be a multiple of 64"
  if cfg.engine == "gluon" and dt.itemsize != 2:
    return f"the gluon engine takes 16-bit operands (wgmma), not {dt.name}"
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
  if not _measured_here("ag", device_kind, world):
    return Verdict(None, f"kernel never measured on {world}x {device_kind}: run "
                   "`python -m jax_autooverlap.bench ag` there once to check and time it")
  # Heuristic between measured shapes: overlap pays when the GEMM is large
  # enough to hide the transfer and to amortise the kernel's fixed cost.
  if m_shard * world < 4096 or k < 2048 or n < 1024:
    return Verdict(None, "heuristic: too small to gain from overlap")
  return Verdict(cfg, "heuristic: large GEMM")
