"""Pick the GPU kernel config for a fused call, or decide the unfused program wins.

Order: explicit `OverlapConfig.kernel` (or impl='triton') -> measured verdict
for this exact shape, GPU kind, group size and dtype -> first-call
measurement (`OverlapConfig.autotune`, on by default: the verdict says
"first_call" and lists the candidates; ops/measure.py times them on the
call's GPUs and records the result, which is a measured verdict from then on)
-> the cost model's choice where it was fit on this GPU kind and group size
-> the unfused program.  Measured verdicts are the JSON shipped in
tuning/data/ plus the user's cache directory (tuning/store.py; user entries
win; a verdict measured with other kernel sources does not count).  A shape
the kernel cannot run (alignment, dtype, shared memory) is never chosen.

Candidates of the first-call measurement: the cost model's fastest configs
where it was fit on this GPU kind and group size, then a small fixed list per
group size (`default_candidates`: chunks, movers and engines; the compile
tests build every one of them for sm_90a), less those the kernel cannot run
(`unsupported`: the resource model).  A model derived for another group size
or GPU kind (tuning/model.py) only orders them and predicts.

Every verdict says where it came from (`source`) and, where the model was
consulted, what it predicts; ao.explain shows both.
"""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from jax_autooverlap import fp8
from jax_autooverlap.reasons import Reason
from jax_autooverlap.tuning import model as cost_model
from jax_autooverlap.tuning import store
from jax_autooverlap.tuning.config import KernelConfig, OverlapConfig, autotune_enabled

SMEM_LIMIT = 227 * 1024  # a CTA's shared memory on sm_90 (opt-in maximum)
SMEM_SLACK = 1024        # shared_memory's allowance for barriers and alignment
GLUON_STAGING_BOX = 8 * 1024  # kernels/gluon_ag_gemm.py box_cols: a mover's staging box
# The small shapes' configs (small_shape_configs) run the most operand stages that fit, up to
# MAX_STAGES: their main loops wait on memory (one CTA per SM, 3 stages: ~0.58 us a k-block at
# 128x128 and 64x256 against the tensor cores' 0.28), as cuBLAS's small-M kernels on H200 run
# 4-8 stages.  Measured (one H200, 22 small-M entries of TP 4 and 8, 23 configs, 3-8 stages,
# docs/NOTES.md, twentieth session): ours at the deepest fitting depth up to 6 took 0.888 of
# 3 stages' time (geometric mean; up to 4: 0.903, 5: 0.886, 8: 0.895), within 3 % of the
# best depth measured on every config (up to 8: 3 configs were not).
MAX_STAGES = 6
KERNEL_DTYPES = ("bfloat16", "float16", "float32", *fp8.FP8_DTYPES)
# The configs the model ranks (per tile shape it has a cost for): the
# benchmark's sweep plus 2 and 16 chunks, the default config first (the
# model's ties go to the earlier config).
CHUNKS = (4, 8, 16, 2)
MOVERS = (8, 16, 32)
AUTOTUNE_CANDIDATES = 3  # the fit model's fastest configs the first call times
MAX_CANDIDATES = 6       # kernel configs timed at most per shape (each is compiled)
SMALL_KEEP = 2           # of those, the usual ones kept for a small shape: each engine's first
# The order in which a first call takes a small shape's own configs (small_class: engine, kind,
# tiles), after the usual first tl and first Gluon candidate: on the shape list's 168 entries
# at M <= 1024 in loopback (one H200, every config timed; `bench shapes --first-call-coverage
# bench/results/shapes-runs.txt`), the best of the 6 configs a first call then times is within
# 0.08 % (AG) and 0.2 % (GEMM+RS) of the best config timed, geometric mean, at most 1.5 % and
# 2.7 % off; before (the first two usual configs, both tl, then tl's packed and split configs
# and the tiles in turn) 0.8 % and 2.6 %, 3 and 9 entries over 5 %, at worst 1.36 and 1.45 x
# (Mixtral gate/up TP 8 M = 1024, Llama-3-8B o TP 4 M = 128).
# Packed 128x64 (GEMM+RS) and 128x256 (AG) came later (2026-12-06): placed after packed
# 128x128 from their wins at the entries that offer them, not from that study.
# Kinds: "tail" (tail_split_config), "packed", "split" (unpacked split-K), "plain".
SMALL_ORDER = (("tl", "tail", 128, 256), ("tl", "packed", 128, 128), ("tl", "packed", 128, 64),
               ("tl", "packed", 128, 256), ("tl", "split", 64, 128),
               ("tl", "split", 64, 256), ("tl", "split", 128, 128), ("gluon", "plain", 64, 256),
               ("gluon", "plain", 64, 128), ("tl", "plain", 64, 256),
               ("gluon", "plain", 128, 128), ("tl", "packed", 64, 256),
               ("tl", "plain", 128, 128), ("tl", "plain", 64, 128))
GLUON_CAPABILITY = "9.0"
# The fixed candidates per group size (2, 4, 8; others take the next larger listed size).
# tl engine: (chunks per peer's shard, mover CTAs) for AG, chunks for GEMM+RS.  Shards shrink
# as the group grows (M / w rows each), so fewer chunks per peer at 8; a GPU's pushes to any
# peers share its NVLink bandwidth, filled by 12-16 tl movers at ~32 GB/s each (the fitted
# per-CTA rate, 2xH200), more where w-1 peers' chunks are interleaved.  Gluon engine (sm_90,
# 16-bit operands): AG with 32 and 64 mover warps (its push rate grows with them: 2xH200,
# docs/NOTES.md; the shipped 2xH200 verdicts that chose Gluon took c4 m32 and c8 m64), GEMM+RS
# with and without a consumer partition per warpgroup.  float32 runs one tl config.
# Groups of 4 and 8 push w - 1 copies of the shard: their AG takes more movers (loopback on one
# H200, TP-rank shapes of Llama-3-8B/70B Q/K/V, docs/NOTES.md: at w = 8 tl 32 movers 1.22-1.36 x
# cuBLAS against 1.24-1.87 x with 16 and 2.0-2.9 x with 8; at w = 4 Gluon 64 and 132 mover
# warps 1.11 x against 1.47 x with 32).
DEFAULT_TL = {"ag": {2: ((4, 16), (8, 16)), 4: ((4, 32), (4, 48)), 8: ((4, 32), (4, 48))},
              "rs": {2: (4, 8), 4: (4, 2), 8: (2, 4)}}
DEFAULT_GLUON = {"ag": {2: ((4, 32), (8, 64)), 4: ((4, 64), (4, 132)), 8: ((2, 64), (2, 132))},
                 "rs": {2: 4, 4: 4, 8: 2}}
LISTED_WORLDS = (2, 4, 8)
# Small shapes (fewer than SMALL_WAVES waves of the default tiles): autotuning and the loopback
# benchmark also time narrower tiles (a warpgroup per 64 rows) and, on the tl engine, split-K
# (kernels/split_k.py) where even those leave SMs idle.  The model has no tile costs for
# them: measured only.
SMALL_WAVES = 2
SMALL_TILES = ((128, 128), (64, 256), (64, 128))
SPLIT_K_MAX = 8
PACKED_TILES = ((128, 128), (64, 256))  # packed_configs: B read once / twice at 16-row shards
PACKED_WIDE = (128, 256)  # packed_configs: AG, where PACKED_TILES[0]'s tiles exceed one wave
PACKED_NARROW = (128, 64)  # packed_configs: GEMM+RS, whole (no split-K)
# AG shapes whose tiles overflow the first wave by at most MAX_CHUNKS tiles (always fewer
# than SMALL_WAVES waves): autotuning and the loopback benchmark also time those tiles split
# in two, where K >= TAIL_MIN_K (tail_split_config).
TAIL_MIN_K = 8192
NUM_SMS = 132  # H100 / H200: where a caller knows no SM count (tests/ptx_dump.py's list)


@dataclasses.dataclass(frozen=True)
class Verdict:
  kernel: KernelConfig | None  # None: run the unfused program
  reason: Reason               # why (shown by ao.explain)
  # explicit | measured | autotuned | model | first_call (to be measured) | "" (no choice made)
  source: str = ""
  key: str | None = None       # this call's tuning-cache key
  candidates: tuple = ()       # what the first-call measurement times (or would, for the model)
  predicted: tuple | None = None  # (fused ms of the model's best config, unfused ms)


def cache_key(op: str, device_kind: str, world: int, m: int, k: int, n: int, dtype,
              b_dtype=None, out_dtype=None) -> str:
  """The tuning cache's key of a call; b_dtype: the second operand's format where it differs
  (two fp8 formats: "float8_e5m2xfloat8_e4m3fn"), so each pairing keeps its own verdict;
  out_dtype: the product's where it is not the default (the operands'; bf16 for fp8), e.g.
  "bfloat16->float32": its kernels differ (select.default_kernel), so does its verdict."""
  name = np.dtype(dtype).name
  if b_dtype is not None and np.dtype(b_dtype) != np.dtype(dtype):
    name += f"x{np.dtype(b_dtype).name}"
  if wide_product(dtype, out_dtype):
    name += f"->{np.dtype(out_dtype).name}"
  return f"{op}|{device_kind}|w{world}|{m}x{k}x{n}|{name}"


def wide_product(dtype, out_dtype) -> bool:
  """Whether the product is not the default of `dtype`'s operands (theirs; bf16 for fp8)."""
  default = "bfloat16" if fp8.is_fp8(dtype) else np.dtype(dtype).name
  return out_dtype is not None and np.dtype(out_dtype).name != default


def default_kernel(dtype, out_dtype=None, op: str = "ag") -> KernelConfig:
  """The config where no measurement names one.  Its engine is $JAX_AUTOOVERLAP_ENGINE if set
  (e.g. `gluon`: run the GPU tests on that engine), else "tl"; float32 always runs "tl".  fp8
  takes K tiles of 128 (one 128-byte swizzled row per stage, as 64 bf16 columns; the same
  shared memory per stage).  A 4-byte output (out_dtype, default the operands') of 16-bit or
  fp8 operands keeps 128x256 tiles (whose kernels store, and tl GEMM+RS's own tiles sum, such
  a tile in column halves) except in the Gluon GEMM+RS of `op` "rs" (wide_output_tiles)."""
  if np.dtype(dtype).itemsize == 4:
    return KernelConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3)
  engine = os.environ.get("JAX_AUTOOVERLAP_ENGINE", "tl")
  cfg = KernelConfig(block_k=128 if fp8.is_fp8(dtype) else 64, engine=engine)
  return wide_output_tiles(cfg, out_dtype, op)


def wide_output_tiles(cfg: KernelConfig, out_dtype, op: str = "ag") -> KernelConfig:
  """`cfg` in tiles that hold a 4-byte output of narrower operands in the kernel of `op` (ag |
  rs) on its engine: the Gluon GEMM+RS stages and sums the whole output tile in shared memory,
  so 128x256 becomes 128x128 there (the same bytes as a 16-bit 128x256 tile); the Gluon AG
  stores such a tile in column halves (gluon_engine.out_block_n) and the tl kernels keep
  their tiles."""
  if (cfg.engine == "gluon" and op == "rs" and out_dtype is not None
      and np.dtype(out_dtype).itemsize == 4 and cfg.block_m * cfg.block_n > 128 * 128):
    return dataclasses.replace(cfg, block_n=128)
  return cfg


def unsupported(m_shard: int, k: int, n: int, dtype, out_dtype, cfg: KernelConfig,
                op: str = "ag") -> str | None:
  """Why the kernel of `op` (ag | rs) cannot run this shape, or None.  K: the AG pushes whole
  64-column blocks of its shard (and fp8 k-blocks); GEMM+RS only reads a and b, through TMA
  descriptors that fill a ragged last k-block with zeros, so any 16-byte-aligned K runs."""
  dt = np.dtype(dtype)
  if dt.name not in KERNEL_DTYPES:
    return f"dtype {dt.name} has no GPU kernel"
  if (k * dt.itemsize) % 16 or (n * dt.itemsize) % 16 or (n * np.dtype(out_dtype).itemsize) % 16:
    return f"K={k} and N={n} rows must be 16-byte aligned for TMA"
  if op != "rs" and k % 64:
    return f"K={k} must be a multiple of 64 (the all-gather pushes 64-column blocks)"
  if fp8.is_fp8(dt):
    if np.dtype(out_dtype).name not in fp8.FP8_OUT_DTYPES:
      return f"fp8 operands give {' or '.join(fp8.FP8_OUT_DTYPES)}, not {np.dtype(out_dtype).name}"
    if op != "rs" and k % cfg.block_k:
      return f"K={k} must be a multiple of the fp8 K tile {cfg.block_k}"
    if cfg.block_k * dt.itemsize < 32:
      return f"fp8 wgmma needs K tiles of at least 32 (block_k={cfg.block_k})"
  if cfg.wg_partitions and op != "rs":
    return "wg_partitions (a consumer partition per warpgroup) exists for GEMM+RS only"
  why = packed_unsupported(cfg, m_shard, n, op)
  if why:
    return why
  if cfg.engine == "gluon" and dt.itemsize > 2:
    return f"the gluon engine takes 16-bit and fp8 operands (wgmma), not {dt.name}"
  if (cfg.engine, op) == ("tl", "rs") and np.dtype(out_dtype).itemsize == 4 and \
      cfg.block_m * cfg.block_n > 128 * 128 and dt.itemsize < 4 and \
      (cfg.split_k > 1 or cfg.pack_shards):
    return (f"the tl GEMM+RS kernel spills registers with split or packed {cfg.block_m}x"
            f"{cfg.block_n} tiles of a 4-byte output (ptxas); tiles of 128x128 or fewer "
            "elements run it, and unsplit unpacked ones (their own tiles summed in halves)")
  need = shared_memory(cfg, op, dt.itemsize, np.dtype(out_dtype).itemsize)
  if need > SMEM_LIMIT:
    return (f"{cfg.engine} {op} kernel of {cfg.block_m}x{cfg.block_n}x{cfg.block_k} tiles in "
            f"{cfg.num_stages} stages needs {need} bytes of shared memory, more than the "
            f"{SMEM_LIMIT} a CTA can have")
  return None


def shared_memory(cfg: KernelConfig, op: str, in_bytes: int, out_bytes: int) -> int:
  """Bytes of shared memory the fused kernel of `op` (ag | rs) allocates with `cfg`, at most
  SMEM_SLACK over Triton's own count under 3.6 and 3.9
  (tests/test_kernel_compile.py compares them): the operand pipeline's stages; the output
  tile's TMA-store buffer (the Gluon kernels; the tl AG+GEMM's unsplit tiles under Triton 3.9,
  which 3.6 stores without); the Gluon AG mover's two staging boxes (gluon_ag_gemm.box_cols:
  8 KB each); and the barriers."""
  stage = (cfg.block_m * cfg.block_k + cfg.block_k * cfg.block_n) * in_bytes
  out_tile = cfg.block_m * cfg.block_n * out_bytes
  # the AGs store a 4-byte tile of 256 columns or more in halves (kernels/ag_gemm.py,
  # gluon_engine.out_block_n)
  halves = 2 if out_bytes == 4 and cfg.block_n >= 256 and op == "ag" else 1
  if cfg.engine == "gluon":
    extra = out_tile // halves + (2 * GLUON_STAGING_BOX if op == "ag" else 0)
  else:
    extra = out_tile // halves if op == "ag" and cfg.split_k == 1 else 0
  return cfg.num_stages * stage + extra + SMEM_SLACK


def packed_unsupported(cfg: KernelConfig, rows: int, n: int, op: str) -> str | None:
  """Why `cfg`'s packed shards (pack_shards) cannot run shards (AG) or owners' rows (GEMM+RS)
  of `rows` rows with N = n, or None: they must fill a tile's rows exactly, two or more
  times; GEMM+RS counts each peer's push per column tile, on MAX_CHUNKS counters."""
  if not cfg.pack_shards:
    return None
  what = "shards" if op == "ag" else "owners' rows"
  if cfg.block_m % rows or cfg.block_m < 2 * rows:
    return (f"pack_shards needs {what} of {rows} rows to fill a tile of block_m={cfg.block_m} "
            "rows two or more times exactly")
  if op == "rs" and math.ceil(n / cfg.block_n) > cost_model.MAX_CHUNKS:
    return (f"pack_shards counts GEMM+RS's pushes per column tile, at most "
            f"{cost_model.MAX_CHUNKS}; N={n} has {math.ceil(n / cfg.block_n)} of {cfg.block_n}")
  return None


def fused_tiles(world: int, shard_rows: int, n: int, cfg: KernelConfig) -> int:
  """Output tiles of one GPU's fused call: every source's (AG) or owner's (RS) shard_rows x n;
  with pack_shards, the gathered world * shard_rows rows in tiles of block_m."""
  if cfg.pack_shards:
    return math.ceil(world * shard_rows / cfg.block_m) * math.ceil(n / cfg.block_n)
  return world * math.ceil(shard_rows / cfg.block_m) * math.ceil(n / cfg.block_n)


def split_counters(cfg: KernelConfig) -> int:
  """The split-K counters of a call: its own row of MAX_CHUNKS arrival counters, less the
  first two with pack_shards (AG: the own shard's copied and claimed parts,
  kernels/ag_gemm.py; GEMM+RS skips them too, so that one rule serves both)."""
  return cost_model.MAX_CHUNKS - (2 if cfg.pack_shards else 0)


def split_k_unsupported(cfg: KernelConfig, tiles: int, k: int) -> str | None:
  """Why split-K (kernels/split_k.py) cannot run a launch of `tiles` output tiles with K = k,
  or None: its counters are the MAX_CHUNKS arrival counters of a rank's own row of the
  workspace, and every part needs a k-block."""
  if cfg.split_k == 1:
    return None
  split = min(cfg.split_tail, tiles) if cfg.split_tail else tiles
  if split > split_counters(cfg):
    return (f"split_k={cfg.split_k} takes at most {split_counters(cfg)} output tiles per "
            f"call, this shape has {split}" + (" to split" if cfg.split_tail else ""))
  if cfg.split_k > math.ceil(k / cfg.block_k):
    return f"split_k={cfg.split_k} exceeds the {math.ceil(k / cfg.block_k)} k-blocks of K={k}"
  return None


def tail_split_config(op: str, world: int, shard_rows: int, k: int, n: int, base: KernelConfig,
                      num_sms: int = NUM_SMS) -> KernelConfig | None:
  """`base` (tl, AG) with the tiles beyond its first wave split in two, or None where that
  cannot pay.  The tl AG's compute CTAs (num_sms - movers) take the first tiles at once, the
  movers join after pushing; with up to MAX_CHUNKS tiles (the split counters) left for a
  second wave, that wave runs on as many CTAs as are free, not one per tile: in halves.  E.g.
  Llama-3-70B Q/K/V at TP = 8, 4k tokens, 160 tiles, 32 movers: 60 split, 1.36 x cuBLAS in
  place of 1.61 (loopback, one H200).  Each split tile's halves pass through memory as fp32
  partials, ~10 us per tile (fitted to the measured times), so only K >= TAIL_MIN_K (a half
  tile of ~40 us or more: at K = 4096 the split lost, 1.65 x against 1.40), and two parts
  (four: 1.48 x)."""
  if op != "ag" or base.engine != "tl" or base.split_k != 1 or k < TAIL_MIN_K:
    return None
  tiles = fused_tiles(world, shard_rows, n, base)
  tail = tiles - (num_sms - min(base.num_comm, num_sms // 2))  # launch.ag_grid's movers
  if not 0 < tail <= cost_model.MAX_CHUNKS:
    return None
  return dataclasses.replace(base, split_k=2, split_tail=tail)


def tile_warps(engine: str, block_m: int, block_n: int) -> int:
  """Gluon: a consumer warpgroup per 64 rows.  tl: 8 warps where a tile has 16K elements or
  more (with 4, the fp32 accumulator and GEMM+RS's sum beside it spill; ptxas -v), else 4."""
  if engine == "gluon":
    return block_m // 16
  return 8 if block_m * block_n >= 64 * 256 else 4


def split_parts(cfg: KernelConfig, tiles: int, k: int, num_sms: int = NUM_SMS) -> int:
  """The split-K parts of `tiles` output tiles with K = k: as many as one wave of the SMs holds,
  at most SPLIT_K_MAX and a k-block each; 1 where the tiles fill the SMs.  More parts than one
  wave did not pay at M = 128 (sixteenth round: the time there is the call's fixed cost)."""
  return max(1, min(SPLIT_K_MAX, num_sms // tiles, math.ceil(k / cfg.block_k)))


def packed_configs(op: str, world: int, shard_rows: int, k: int, n: int, base: KernelConfig,
                   num_sms: int = NUM_SMS) -> list[KernelConfig]:
  """`tl` with the shards (AG) or owners' rows (GEMM+RS) packed into the row tiles
  (KernelConfig.pack_shards) and split-K over the SMs, for shards of fewer rows than a tile:
  one config per tile of PACKED_TILES that can pack them (packed_unsupported).  At M = 128 on
  8 GPUs (16-row shards) the 64-row tiles of one source or owner each read B 8 times per call
  and are three quarters empty; 128-row packed tiles read it once.  AG: where the 128x128 tiles
  exceed one wave (64-row shards, e.g. M = 512 at TP 8, and N > 4224), also 128x256
  (PACKED_WIDE): Llama-3-70B gate/up, TP 8, M = 512 101 us against 130 (H100, loopback).
  GEMM+RS: also 128x64 tiles whole (PACKED_NARROW): twice the 128x128 tiles without split-K's
  fp32 partials, whose store and count make most of a split part's epilogue (w = 8, one H200:
  128x4096x4096 11.7 us against 14.3 split in 4 and 13.1 in 2; 256x4096x4096 13.4 against
  16.8 whole; even at K = 1792 per rank)."""
  out = []
  square = dataclasses.replace(base, block_m=PACKED_TILES[0][0], block_n=PACKED_TILES[0][1],
                               pack_shards=True, engine="tl", split_k=1, split_tail=0,
                               wg_partitions=False)
  two_waves = fused_tiles(world, shard_rows, n, square) > num_sms
  wide = (PACKED_WIDE,) if op == "ag" and two_waves else ()
  narrow = (PACKED_NARROW,) if op == "rs" else ()
  for bm, bn in PACKED_TILES + wide + narrow:
    cfg = dataclasses.replace(base, engine="tl", block_m=bm, block_n=bn, pack_shards=True,
                              num_warps=tile_warps("tl", bm, bn), wg_partitions=False,
                              split_k=1, split_tail=0)
    if packed_unsupported(cfg, shard_rows, n, op):
      continue
    tiles = fused_tiles(world, shard_rows, n, cfg)
    # whole tiles where there are too many to count their parts, or narrow ones
    split = (split_parts(cfg, tiles, k, num_sms)
             if tiles <= split_counters(cfg) and (bm, bn) != PACKED_NARROW else 1)
    out.append(dataclasses.replace(cfg, split_k=split))
  return out


def small_shape_configs(op: str, world: int, shard_rows: int, k: int, n: int, dtype, out_dtype,
                        base: KernelConfig, num_sms: int = NUM_SMS,
                        engines=("tl", "gluon")) -> list[KernelConfig]:
  """Configs worth timing beside `base` where its tiles leave SMs idle (fewer than SMALL_WAVES
  waves of output tiles: shard_rows rows of each of `world` sources or owners, n columns;
  K = k): per engine, the SMALL_TILES (tile_warps), on `tl` split-K over the smallest
  tile whose tiles fit its counters, each in its deepest pipeline (deepest_stages), and the
  base with its second wave split where that wave is short (tail_split_config).  Chunks and
  movers stay the base's (a shard of one row tile is one chunk; fp8 keeps the base's K tiles
  of 128).  Only configs that run the shape; none for 32-bit dtypes (no small-tile
  measurements)."""
  if (np.dtype(dtype).itemsize == 4
      or fused_tiles(world, shard_rows, n, base) >= SMALL_WAVES * num_sms):
    return []
  fits = lambda c: (unsupported(shard_rows, k, n, dtype, out_dtype, c, op) is None
                    and split_k_unsupported(c, fused_tiles(world, shard_rows, n, c), k) is None)
  out = []
  for engine in engines:
    for bm, bn in SMALL_TILES:
      try:
        cfg = dataclasses.replace(base, engine=engine, block_m=bm, block_n=bn,
                                  num_warps=tile_warps(engine, bm, bn),
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
                                num_warps=tile_warps("tl", bm, bn), wg_partitions=False,
                                split_k=1)
      tiles = fused_tiles(world, shard_rows, n, cfg)
      cfg = dataclasses.replace(cfg, split_k=split_parts(cfg, tiles, k, num_sms))
      if cfg.split_k >= 2 and tiles <= split_counters(cfg) and fits(cfg):
        out.append(cfg)
        break
  if "tl" in engines:
    out += [c for c in packed_configs(op, world, shard_rows, k, n, base, num_sms) if fits(c)]
  sizes = np.dtype(dtype).itemsize, np.dtype(out_dtype).itemsize
  out = [deepest_stages(c, op, *sizes) for c in out]
  tail = tail_split_config(op, world, shard_rows, k, n, base, num_sms) if "tl" in engines else None
  return out + ([tail] if tail is not None and fits(tail) and tail not in out else [])


def deepest_stages(cfg: KernelConfig, op: str, in_bytes: int, out_bytes: int) -> KernelConfig:
  """`cfg` with the most operand stages, at most MAX_STAGES and no fewer than its own, whose
  shared memory fits a CTA (shared_memory)."""
  deeper = [s for s in range(cfg.num_stages, MAX_STAGES + 1)
            if shared_memory(dataclasses.replace(cfg, num_stages=s), op, in_bytes,
                             out_bytes) <= SMEM_LIMIT]
  return dataclasses.replace(cfg, num_stages=max(deeper, default=cfg.num_stages))


def candidate_configs(op: str, model: cost_model.CostModel, dtype,
                      out_dtype=None) -> list[KernelConfig]:
  """Every config the model can rank: its tile shapes x chunk counts (x movers for AG)."""
  base = default_kernel(dtype, out_dtype, op)
  out = []
  for tile in sorted(model.tiles):
    bm, bn, bk = map(int, tile.split("x"))
    for chunks in CHUNKS:
      for movers in (MOVERS if op == "ag" else (base.num_comm,)):
        out.append(dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk, chunks=chunks,
                                       num_comm=movers))
  return out


def listed_world(world: int) -> int:
  """The group size whose fixed candidates a group of `world` takes."""
  return next((w for w in LISTED_WORLDS if w >= world), LISTED_WORLDS[-1])


def default_candidates(op: str, world: int, dtype, compute_capability=None,
                       out_dtype=None) -> tuple:
  """The fixed first-call candidates of a group size (module docstring), the Gluon engine's
  only where a first call times it (gluon_candidate); in default_kernel's tiles for out_dtype
  (default the operands')."""
  w = listed_world(world)
  if np.dtype(dtype).itemsize == 4:
    base = default_kernel(dtype)
    first = DEFAULT_TL[op][w][0]
    chunks, movers = first if op == "ag" else (first, base.num_comm)
    return (dataclasses.replace(base, chunks=chunks, num_comm=movers),)
  base = dataclasses.replace(default_kernel(dtype, out_dtype, op), engine="tl")
  out = [dataclasses.replace(base, chunks=c, num_comm=m) for c, m in DEFAULT_TL["ag"][w]] \
      if op == "ag" else [dataclasses.replace(base, chunks=c) for c in DEFAULT_TL["rs"][w]]
  if gluon_candidate(dtype, compute_capability):
    gluon = wide_output_tiles(dataclasses.replace(base, engine="gluon"), out_dtype, op)
    if op == "ag":
      out += [dataclasses.replace(gluon, chunks=c, num_comm=m) for c, m in DEFAULT_GLUON["ag"][w]]
    else:
      out += [dataclasses.replace(gluon, chunks=DEFAULT_GLUON["rs"][w], wg_partitions=wg)
              for wg in (False, True)]
  return tuple(out)


def gluon_candidate(dtype, compute_capability) -> bool:
  """Whether a first call times the Gluon engine: sm_90 and 16-bit or fp8 operands (with a
  product of their width or float32: tests/test_gpu_loopback.py -k float32_products)."""
  return str(compute_capability) == GLUON_CAPABILITY and np.dtype(dtype).itemsize <= 2


def first_call_candidates(op: str, model, world: int, sizes: tuple[int, int, int], cfg_rows: int,
                          dtype, out_dtype, compute_capability=None):
  """(candidates, predicted) of a first-call measurement: the fit model's fastest configs, then
  the fixed list (a derived model orders the tl ones), less what the kernel cannot run, at most
  MAX_CANDIDATES; for a small shape (small_shape_configs: fewer than SMALL_WAVES waves of
  tiles) each engine's first of those (SMALL_KEEP in all), then the shape's narrower tiles,
  split-K and packed shards (no model ranks them) in SMALL_ORDER, MAX_CANDIDATES in all;
  predicted: the model's (fused ms of the best tl candidate, unfused ms) or None."""
  rows, k, cols = sizes
  runs = lambda c: unsupported(cfg_rows, k, cols, dtype, out_dtype, c, op) is None
  fixed = [c for c in default_candidates(op, world, dtype, compute_capability, out_dtype)
           if runs(c)]
  out_item = np.dtype(out_dtype).itemsize
  tl = lambda configs: [c for c in configs if c.engine == "tl"]  # the model's tile costs are tl's
  if model is None:
    ordered = fixed
  elif model.extrapolated:
    ordered = [c for _, c in model.rank(op, rows, k, cols, tl(fixed), out_item)]
    ordered += [c for c in fixed if c not in ordered]
  else:
    space = [c for c in candidate_configs(op, model, dtype, out_dtype) if runs(c)]
    ordered = [c for _, c in model.rank(op, rows, k, cols, space, out_item)[:AUTOTUNE_CANDIDATES]]
    ordered += [c for c in fixed if c not in ordered]
  engines = ("tl", "gluon") if gluon_candidate(dtype, compute_capability) else ("tl",)
  base = next(iter(tl(ordered)), default_kernel(dtype, out_dtype, op))
  small = [c for c in small_shape_configs(op, world, cfg_rows, k, cols, dtype, out_dtype, base,
                                          model.num_sms if model else NUM_SMS, engines)
           if c not in ordered]
  if small:
    # the usual: each engine's first (tl's: the model's best), then the small ones in the
    # measured SMALL_ORDER
    firsts = [next(c for c in ordered if c.engine == e) for e in engines
              if any(c.engine == e for c in ordered)]
    usual = (firsts + [c for c in ordered if c not in firsts])[:SMALL_KEEP]
    small.sort(key=lambda c: SMALL_ORDER.index(small_class(c)) if small_class(c) in SMALL_ORDER
               else len(SMALL_ORDER))
    ordered = usual + small[:MAX_CANDIDATES - len(usual)]
  else:
    ordered = ordered[:MAX_CANDIDATES]
  if model is None:
    return tuple(ordered), None
  ranked = model.rank(op, rows, k, cols, [c for c in tl(ordered)
                                          if c.split_k == 1 and not c.pack_shards], out_item)
  predicted = (ranked[0][0], model.unfused_ms(op, rows, k, cols, out_item)) if ranked else None
  return tuple(ordered), predicted


def small_class(cfg: KernelConfig) -> tuple:
  """(engine, kind, block_m, block_n) of a small shape's config (SMALL_ORDER): kind "tail"
  (only the last tiles split), "packed" (whatever its split), "split" or "plain"."""
  kind = ("tail" if cfg.split_tail else "packed" if cfg.pack_shards else
          "split" if cfg.split_k > 1 else "plain")
  return cfg.engine, kind, cfg.block_m, cfg.block_n


def _describe(cfg: KernelConfig, op: str) -> str:
  movers = f" movers={cfg.num_comm}" if op == "ag" else ""
  return f"chunks={cfg.chunks}{movers} tiles {cfg.block_m}x{cfg.block_n}x{cfg.block_k}"


def measured_verdict(hit: dict, key: str) -> Verdict:
  """The verdict of a tuning-cache entry (first-call measurement or benchmark)."""
  if hit.get("source") in ("first_call", "autotune"):
    return _first_call_verdict(hit, key)
  times = ""
  if hit.get("ours_ms") is not None and hit.get("unfused_ms") is not None:
    times = f"{hit['ours_ms']:.3f} vs unfused {hit['unfused_ms']:.3f} ms"
  if hit.get("impl") == "triton":
    return Verdict(KernelConfig(**hit["kernel"]), Reason(
        "kernel", "measured: fused kernel faster" + (f" ({times})" if times else "")),
        "measured", key)
  detail = "; ".join(x for x in (hit.get("note", ""), times.replace(" vs ", " fused vs ")) if x)
  return Verdict(None, Reason("tuner_unfused", "measured: unfused faster"
                              + (f" ({detail})" if detail else "")), "measured", key)


def _first_call_verdict(hit: dict, key: str) -> Verdict:
  ours, unfused = hit.get("ours_ms"), hit.get("unfused_ms")
  times = (f"; {ours:.3f} ms vs unfused {unfused:.3f} ms" if ours is not None and
           unfused is not None else f"; {ours:.3f} ms" if ours is not None else "")
  note = hit.get("note", "")
  if hit.get("impl") == "triton":
    return Verdict(KernelConfig(**hit["kernel"]), Reason("kernel", f"autotuned: {note}{times}"),
                   "autotuned", key)
  code = "measure_failed" if hit.get("measure_failed") else "tuner_unfused"
  return Verdict(None, Reason(code, f"autotuned: unfused program kept: {note}{times}"),
                 "autotuned", key)


def _model_verdict(op: str, model, rows: int, k: int, cols: int, dtype, out_dtype,
                   key: str, cfg_rows: int) -> Verdict:
  """The model's choice: its fastest runnable config if that beats its unfused prediction."""
  out_item = np.dtype(out_dtype).itemsize
  configs = [c for c in candidate_configs(op, model, dtype, out_dtype)
             if unsupported(cfg_rows, k, cols, dtype, out_dtype, c, op) is None]
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


def _prediction(model, predicted) -> str:
  if model is None or predicted is None:
    return ""
  fused, unfused = predicted
  how = f"derived: {'; '.join(model.derived)}" if model.extrapolated else model.source
  return f"; model: fused {fused:.3f} ms vs unfused {unfused:.3f} ms predicted ({how})"


def _choose(op: str, config: OverlapConfig, device_kind: str, world: int, key: str,
            sizes: tuple[int, int, int], shard_rows: int, dtype, out_dtype,
            why_not: str | None, compute_capability, props) -> Verdict:
  explicit = config.kernel
  cfg = explicit or default_kernel(dtype, out_dtype, op)
  why_not = (why_not or unsupported(shard_rows, sizes[1], sizes[2], dtype, out_dtype, cfg, op)
             or split_k_unsupported(cfg, fused_tiles(world, shard_rows, sizes[2], cfg), sizes[1]))
  if why_not:
    return Verdict(None, Reason("unsupported_shape", why_not))
  if explicit is not None or config.impl == "triton":
    return Verdict(cfg, Reason("forced", "explicit config" if explicit else "impl='triton'"),
                   "explicit", key)
  hit = store.verdicts().get(key)
  if hit is not None:
    return measured_verdict(hit, key)
  stale = store.stale().get(key)
  stale = f"; the cached verdict was {stale}" if stale else ""
  model = cost_model.load(device_kind, world, dtype, props)
  name = np.dtype(dtype).name
  if autotune_enabled(config):
    candidates, predicted = first_call_candidates(op, model, world, sizes, shard_rows, dtype,
                                                  out_dtype, compute_capability)
    if not candidates:
      return Verdict(None, Reason("unsupported_shape", "no kernel candidate fits this shape"))
    return Verdict(None, Reason(
        "first_call", f"measured on the first call: the unfused program and {len(candidates)} "
        f"kernel configs on {world}x {device_kind} ({name}){_prediction(model, predicted)}"
        f"{stale}"), "first_call", key, candidates, predicted)
  if model is None or model.extrapolated:
    predicted = None if model is None else first_call_candidates(
        op, model, world, sizes, shard_rows, dtype, out_dtype, compute_capability)[1]
    return Verdict(None, Reason(
        "never_measured", f"kernel never measured on {world}x {device_kind} for {name} and "
        "first-call measurement is off (OverlapConfig(autotune=False) or "
        "JAX_AUTOOVERLAP_AUTOTUNE=0): turn it on, or run `python -m jax_autooverlap.bench "
        f"calibrate` (cost model) or `python -m jax_autooverlap.bench {op}` (verdicts for its "
        f"shapes) there once{_prediction(model, predicted)}{stale}"), "", key)
  return _model_verdict(op, model, *sizes, dtype, out_dtype, key, shard_rows)


def choose_rs(config: OverlapConfig, device_kind: str, world: int, m: int, k: int, n: int,
              dtype, out_dtype, *, compute_capability=None, props=None,
              b_dtype=None) -> Verdict:
  """Kernel config for psum_scatter(a @ b, rows) with per-device a[m, k], b[k, n].

  compute_capability: the GPUs' ("9.0"), for the engines the first call may time; props: the
  device's properties as read (model.DeviceProps), for a model derived for its kind; b_dtype:
  b's format where it differs from a's (cache_key)."""
  key = cache_key("rs", device_kind, world, m, k * world, n, dtype, b_dtype, out_dtype)
  why_not = f"M={m} is not divisible by the axis size {world}" if m % world else None
  return _choose("rs", config, device_kind, world, key, (m, k, n), m // world, dtype, out_dtype,
                 why_not, compute_capability, props)


def choose_ag(config: OverlapConfig, device_kind: str, world: int, m_shard: int, k: int, n: int,
              dtype, out_dtype, *, compute_capability=None, props=None,
              b_dtype=None) -> Verdict:
  """Kernel config for all_gather(rows) @ b with per-device shapes a[m_shard, k], b[k, n]
  (keywords as choose_rs)."""
  key = cache_key("ag", device_kind, world, m_shard * world, k, n * world, dtype, b_dtype,
                  out_dtype)
  return _choose("ag", config, device_kind, world, key, (m_shard, k, n), m_shard, dtype,
                 out_dtype, None, compute_capability, props)
