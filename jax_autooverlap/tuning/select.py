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
import math
import os

import numpy as np

from jax_autooverlap.reasons import Reason
from jax_autooverlap.tuning import model as cost_model
from jax_autooverlap.tuning import store
from jax_autooverlap.tuning.config import KernelConfig, OverlapConfig

SMEM_LIMIT = 227 * 1024
KERNEL_DTYPES = ("bfloat16", "float16", "float32")
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
# Small shapes (fewer than SMALL_WAVES waves of the default tiles): autotuning and the loopback
# benchmark also time narrower tiles (a warpgroup per 64 rows) and, on the tl engine, split-K
# (kernels/split_k.py) where even those leave SMs idle.  The model has no tile costs for
# them: measured only.
SMALL_WAVES = 2
SMALL_TILES = ((128, 128), (64, 256), (64, 128))
SPLIT_K_MAX = 8
NUM_SMS = 132  # H100 / H200: where a caller knows no SM count (tests/ptx_dump.py's list)


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


def fused_tiles(world: int, shard_rows: int, n: int, cfg: KernelConfig) -> int:
  """Output tiles of one GPU's fused call: every source's (AG) or owner's (RS) shard_rows x n."""
  return world * math.ceil(shard_rows / cfg.block_m) * math.ceil(n / cfg.block_n)


def split_k_unsupported(cfg: KernelConfig, tiles: int, k: int) -> str | None:
  """Why split-K (kernels/split_k.py) cannot run a launch of `tiles` output tiles with K = k,
  or None: its counters are the MAX_CHUNKS arrival counters of a rank's own row of the
  workspace, and every part needs a k-block."""
  if cfg.split_k == 1:
    return None
  if tiles > cost_model.MAX_CHUNKS:
    return (f"split_k={cfg.split_k} takes at most {cost_model.MAX_CHUNKS} output tiles per "
            f"call, this shape has {tiles}")
  if cfg.split_k > math.ceil(k / cfg.block_k):
    return f"split_k={cfg.split_k} exceeds the {math.ceil(k / cfg.block_k)} k-blocks of K={k}"
  return None


def _small_tile_warps(engine: str, block_m: int, block_n: int) -> int:
  """Gluon: a consumer warpgroup per 64 rows.  tl: 8 warps where a tile has 16K elements or
  more (with 4, the fp32 accumulator and GEMM+RS's sum beside it spill; ptxas -v), else 4."""
  if engine == "gluon":
    return block_m // 16
  return 8 if block_m * block_n >= 64 * 256 else 4


def small_shape_configs(op: str, world: int, shard_rows: int, k: int, n: int, dtype, out_dtype,
                        base: KernelConfig, num_sms: int = NUM_SMS,
                        engines=("tl", "gluon")) -> list[KernelConfig]:
  """Configs worth timing beside `base` where its tiles leave SMs idle (fewer than SMALL_WAVES
  waves of output tiles: shard_rows rows of each of `world` sources or owners, n columns;
  K = k): per engine, the SMALL_TILES (_small_tile_warps), and on `tl` split-K over the
  smallest tile whose tiles fit its counters.  Chunks and movers stay the base's (a shard of one row tile is one chunk).
  Only configs that run the shape; none for 32-bit dtypes (no small-tile measurements)."""
  if np.dtype(dtype).itemsize != 2 or fused_tiles(world, shard_rows, n, base) >= SMALL_WAVES * num_sms:
    return []
  fits = lambda c: (unsupported(shard_rows, k, n, dtype, out_dtype, c) is None
                    and split_k_unsupported(c, fused_tiles(world, shard_rows, n, c), k) is None)
  out = []
  for engine in engines:
    for bm, bn in SMALL_TILES:
      try:
        cfg = dataclasses.replace(base, engine=engine, block_m=bm, block_n=bn,
                                  num_warps=_small_tile_warps(engine, bm, bn),
                                  wg_partitions=False, split_k=1)
      except ValueError:  # the engine does not take these tiles
        continue
      if cfg != base and fits(cfg):
        out.append(cfg)
  if "tl" in engines:
    # the smallest tile whose tiles fit the split counters: the least fp32 partial traffic
    # and, on a shard of few rows, the least idle MMA rows (not 128x256: its sum of the parts
    # beside the accumulator spills)
    for bm, bn in SMALL_TILES[::-1]:
      cfg = dataclasses.replace(base, engine="tl", block_m=bm, block_n=bn,
                                num_warps=_small_tile_warps("tl", bm, bn), wg_partitions=False,
                                split_k=1)
      tiles = fused_tiles(world, shard_rows, n, cfg)
      split = min(SPLIT_K_MAX, num_sms // tiles, math.ceil(k / cfg.block_k))
      cfg = dataclasses.replace(cfg, split_k=max(split, 1))
      if split >= 2 and tiles <= cost_model.MAX_CHUNKS and fits(cfg):
        out.append(cfg)
        break
  return out


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
  runs (compute capability 9.0, 16-bit operands; AG once per GLUON_MOVERS, GEMM+RS once per
  GLUON_RS_WG_PARTITIONS) and the candidates' other tiles (small shapes) on it too: the tuner
  chooses between engines by measurement.  sizes: (rows per GPU, K, N) as `unsupported`
  takes them."""
  if not candidates or str(compute_capability) != GLUON_CAPABILITY:
    return candidates
  best = candidates[0]
  variants = ([dict(num_comm=m) for m in GLUON_MOVERS] if op == "ag"
              else [dict(wg_partitions=wg) for wg in GLUON_RS_WG_PARTITIONS])
  tries = [(best, v) for v in variants]
  # the small shapes' narrower tiles (small_shape_configs) on the Gluon engine too
  tries += [(c, {}) for c in candidates[1:]
            if c.split_k == 1 and (c.block_m, c.block_n) != (best.block_m, best.block_n)]
  extra = []
  for cfg, variant in tries:
    try:
      cfg = dataclasses.replace(cfg, engine="gluon", num_warps=cfg.block_m // 16, **variant)
    except ValueError:  # the model's tiles do not fit the engine
      continue
    if unsupported(*sizes, dtype, out_dtype, cfg) is None and cfg not in (*candidates, *extra):
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
  # small shapes: also the narrower tiles and split-K, which the model cannot rank
  small = small_shape_configs(op, model.world, cfg_rows, k, cols, dtype, out_dtype, best,
                              model.num_sms, ("tl",))
  candidates = tuple(c for _, c in ranked[:AUTOTUNE_CANDIDATES]) + tuple(small)
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
  why_not = (why_not or unsupported(shard_rows, sizes[1], sizes[2], dtype, out_dtype, cfg)
             or split_k_unsupported(cfg, fused_tiles(world, shard_rows, sizes[2], cfg), sizes[1]))
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
