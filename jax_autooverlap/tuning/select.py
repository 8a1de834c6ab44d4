"""Pick the GPU kernel config for a fused call, or decide the unfused program wins.

Order: explicit `OverlapConfig.kernel` (or impl='triton') -> measured verdict
for this exact shape -> the cost model's choice (tuning/model.py) -> the
unfused program.  Measured verdicts are the JSON shipped in tuning/data/
plus the user's cache directory (tuning/store.py, where
`python -m jax_autooverlap.bench ag|rs` and first-call autotuning record
them; user entries win).  The cost model covers any shape on a (GPU kind,
group size, dtype) it has parameters for (shipped, or from
`python -m jax_autooverlap.bench calibrate`); elsewhere the kernel has never
been checked against the unfused program and is not chosen.  A shape the
kernel cannot run (alignment, dtype, shared memory) is never chosen.

Every verdict says where it came from (`source`) and, where the model was
consulted, what it predicts; ao.explain shows both.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from jax_autooverlap import fp8
from jax_autooverlap.reasons import Reason
from jax_autooverlap.tuning import model as cost_model
from jax_autooverlap.tuning import store
from jax_autooverlap.tuning.config import KernelConfig, OverlapConfig

SMEM_LIMIT = 227 * 1024
KERNEL_DTYPES = ("bfloat16", "float16", "float32", *fp8.FP8_DTYPES)
# The configs the model ranks (per tile shape it has a cost for): the
# benchmark's sweep plus 2 and 16 chunks, the default config first (the
# model's ties go to the earlier config).
CHUNKS = (4, 8, 16, 2)
MOVERS = (8, 16, 32)
AUTOTUNE_CANDIDATES = 3
# Autotuning also times the model's best config on the Gluon engine (sm_90, 16-bit operands),
# which the model does not rank (its tile costs are the tl kernels'); AG with these mover
# warps (the Gluon AG push rate grows with the movers: docs/NOTES.md, two H200s), GEMM+RS
# with and without a consumer partition per warpgroup (0.5-1.1 % faster in loopback).
GLUON_MOVERS = (32, 64)
GLUON_RS_WG_PARTITIONS = (False, True)
GLUON_CAPABILITY = "9.0"


@dataclasses.dataclass(frozen=True)
class Verdict:
  kernel: KernelConfig | None  # None: run the unfused program
  reason: Reason               # why (shown by ao.explain)
  source: str = ""             # explicit | measured | autotuned | model | "" (no choice made)
  key: str | None = None       # this call's tuning-cache key
  candidates: tuple = ()       # the model's fastest configs (what autotuning times)
  predicted: tuple | None = None  # (fused ms of the model's best config, unfused ms)


def cache_key(op: str, device_kind: str, world: int, m: int, k: int, n: int, dtype) -> str:
  return f"{op}|{device_kind}|w{world}|{m}x{k}x{n}|{np.dtype(dtype).name}"


def default_kernel(dtype) -> KernelConfig:
  """The config where no measurement names one.  Its engine is $JAX_AUTOOVERLAP_ENGINE if set
  (e.g. `gluon`: run the GPU tests on that engine), else "tl"; float32 always runs "tl".  fp8
  takes K tiles of 128 (one 128-byte swizzled row per stage, as 64 bf16 columns; the same
  shared memory per stage)."""
  if np.dtype(dtype).itemsize == 4:
    return KernelConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3)
  engine = os.environ.get("JAX_AUTOOVERLAP_ENGINE", "tl")
  if fp8.is_fp8(dtype):
    return KernelConfig(block_k=128, engine=engine)
  return KernelConfig(engine=engine)


def unsupported(m_shard: int, k: int, n: int, dtype, out_dtype, cfg: KernelConfig) -> str | None:
  """Why the kernel cannot run this shape, or None."""
  dt = np.dtype(dtype)
  if dt.name not in KERNEL_DTYPES:
    return f"dtype {dt.name} has no GPU kernel"
  if (k * dt.itemsize) % 16 or (n * dt.itemsize) % 16 or (n * np.dtype(out_dtype).itemsize) % 16:
    return f"K={k} and N={n} rows must be 16-byte aligned for TMA"
  if k % 64:
    return f"K={k} must be a multiple of 64"
  if fp8.is_fp8(dt):
    if np.dtype(out_dtype).name not in fp8.FP8_OUT_DTYPES:
      return f"fp8 operands give {' or '.join(fp8.FP8_OUT_DTYPES)}, not {np.dtype(out_dtype).name}"
    if k % cfg.block_k:
      return f"K={k} must be a multiple of the fp8 K tile {cfg.block_k}"
    if cfg.block_k * dt.itemsize < 32:
      return f"fp8 wgmma needs K tiles of at least 32 (block_k={cfg.block_k})"
  if cfg.engine == "gluon" and dt.itemsize > 2:
    return f"the gluon engine takes 16-bit and fp8 operands (wgmma), not {dt.name}"
  if cfg.smem_bytes(dt.itemsize, np.dtype(out_dtype).itemsize) > SMEM_LIMIT:
    return f"kernel config needs more than {SMEM_LIMIT} bytes of shared memory"
  return None


def candidate_configs(op: str, model: cost_model.CostModel, dtype) -> list[KernelConfig]:
  """Every config the model can rank: its tile shapes x chunk counts (x movers for AG)."""
  base = default_kernel(dtype)
  out = []
  for tile in sorted(model.tiles):
    bm, bn, bk = map(int, tile.split("x"))
    for chunks in CHUNKS:
      for movers in (MOVERS if op == "ag" else (base.num_comm,)):
        out.append(dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk, chunks=chunks,
                                       num_comm=movers))
  return out


def with_engines(op: str, candidates: tuple, compute_capability, sizes: tuple[int, int, int],
                 dtype, out_dtype) -> tuple:
  """Autotuning candidates: the model's, then its best config on the Gluon engine where that
  runs (compute capability 9.0, 16-bit or fp8 operands; AG once per GLUON_MOVERS, GEMM+RS once per
  GLUON_RS_WG_PARTITIONS): the tuner chooses between engines by measurement.  sizes: (rows per
  GPU, K, N) as `unsupported` takes them."""
  if not candidates or str(compute_capability) != GLUON_CAPABILITY:
    return candidates
  best = candidates[0]
  variants = ([dict(num_comm=m) for m in GLUON_MOVERS] if op == "ag"
              else [dict(wg_partitions=wg) for wg in GLUON_RS_WG_PARTITIONS])
  extra = []
  for variant in variants:
    try:
      cfg = dataclasses.replace(best, engine="gluon", **variant)
    except ValueError:  # the model's tiles do not fit the engine
      continue
    if unsupported(*sizes, dtype, out_dtype, cfg) is None and cfg not in candidates:
      extra.append(cfg)
  return tuple(candidates) + tuple(extra)


def _describe(cfg: KernelConfig, op: str) -> str:
  movers = f" movers={cfg.num_comm}" if op == "ag" else ""
  return f"chunks={cfg.chunks}{movers} tiles {cfg.block_m}x{cfg.block_n}x{cfg.block_k}"


def measured_verdict(hit: dict, key: str) -> Verdict:
  """The verdict of a tuning-cache entry (benchmark or autotuning)."""
  source = "autotuned" if hit.get("source") == "autotune" else "measured"
  times = ""
  if hit.get("ours_ms") is not None and hit.get("unfused_ms") is not None:
    times = f"{hit['ours_ms']:.3f} vs unfused {hit['unfused_ms']:.3f} ms"
  if hit.get("impl") == "triton":
    return Verdict(KernelConfig(**hit["kernel"]), Reason(
        "kernel", f"{source}: fused kernel faster" + (f" ({times})" if times else "")), source, key)
  detail = "; ".join(x for x in (hit.get("note", ""), times.replace(" vs ", " fused vs ")) if x)
  return Verdict(None, Reason("tuner_unfused", f"{source}: unfused faster"
                              + (f" ({detail})" if detail else "")), source, key)


def _model_verdict(op: str, model, rows: int, k: int, cols: int, dtype, out_dtype,
                   key: str, cfg_rows: int) -> Verdict:
  """The model's choice: its fastest runnable config if that beats its unfused prediction."""
  out_item = np.dtype(out_dtype).itemsize
  configs = [c for c in candidate_configs(op, model, dtype)
             if unsupported(cfg_rows, k, cols, dtype, out_dtype, c) is None]
  ranked = model.rank(op, rows, k, cols, configs, out_item)
  unfused = model.unfused_ms(op, rows, k, cols, out_item)
  if not ranked:
    return Verdict(None, Reason("unsupported_shape", "model: no kernel config it covers fits this "
                                f"shape ({model.source})"), "model", key)
  best_ms, best = ranked[0]
  candidates = tuple(c for _, c in ranked[:AUTOTUNE_CANDIDATES])
  if best_ms < unfused:
    return Verdict(best, Reason("kernel", f"model: fused {best_ms:.3f} ms vs unfused "
                                f"{unfused:.3f} ms predicted, {_describe(best, op)} "
                                f"({model.source})"), "model", key, candidates, (best_ms, unfused))
  return Verdict(None, Reason("tuner_unfused", f"model: unfused {unfused:.3f} ms vs fused "
                              f"{best_ms:.3f} ms predicted ({model.source})"), "model", key,
                 candidates, (best_ms, unfused))


def _choose(op: str, config: OverlapConfig, device_kind: str, world: int, key: str,
            sizes: tuple[int, int, int], shard_rows: int, dtype, out_dtype,
            why_not: str | None) -> Verdict:
  explicit = config.kernel
  cfg = explicit or default_kernel(dtype)
  why_not = why_not or unsupported(shard_rows, sizes[1], sizes[2], dtype, out_dtype, cfg)
  if why_not:
    return Verdict(None, Reason("unsupported_shape", why_not))
  if explicit is not None or config.impl == "triton":
    return Verdict(cfg, Reason("forced", "explicit config" if explicit else "impl='triton'"),
                   "explicit", key)
  hit = store.verdicts().get(key)
  if hit is not None:
    return measured_verdict(hit, key)
  model = cost_model.load(device_kind, world, dtype)
  if model is None:
    return Verdict(None, Reason(
        "never_measured", f"kernel never measured on {world}x {device_kind} for "
        f"{np.dtype(dtype).name}: run `python -m jax_autooverlap.bench calibrate` (cost model) "
        f"or `python -m jax_autooverlap.bench {op}` (verdicts for its shapes) there once"), "",
        key)
  return _model_verdict(op, model, *sizes, dtype, out_dtype, key, shard_rows)


def choose_rs(config: OverlapConfig, device_kind: str, world: int, m: int, k: int, n: int,
              dtype, out_dtype) -> Verdict:
  """Kernel config for psum_scatter(a @ b, rows) with per-device a[m, k], b[k, n]."""
  key = cache_key("rs", device_kind, world, m, k * world, n, dtype)
  why_not = f"M={m} is not divisible by the axis size {world}" if m % world else None
  return _choose("rs", config, device_kind, world, key, (m, k, n), m // world, dtype, out_dtype,
                 why_not)


def choose_ag(config: OverlapConfig, device_kind: str, world: int, m_shard: int, k: int, n: int,
              dtype, out_dtype) -> Verdict:
  """Kernel config for all_gather(rows) @ b with per-device shapes a[m_shard, k], b[k, n]."""
  key = cache_key("ag", device_kind, world, m_shard * world, k, n * world, dtype)
  return _choose("ag", config, device_kind, world, key, (m_shard, k, n), m_shard, dtype,
                 out_dtype, None)
