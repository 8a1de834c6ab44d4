"""The loopback benchmark's runs, table and command line (`python -m jax_autooverlap.bench ag|rs
--loopback`; the method: this package's docstring)."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import sys
import time

import numpy as np

from jax_autooverlap.bench import common, timing
from jax_autooverlap.bench.loopback.fixture import WORLD, Case, Loopback, np_dtype
from jax_autooverlap.bench.loopback.programs import engine_program, fused_program, gemm_program

DEFAULT_SHAPES = ["4096x8192x8192", "16384x8192x8192", "16384x8192x28672", "8192x4096x4096"]
MAX_REL_ERR = 2e-2
log = common.logger("loopback")


def kernel_configs(case: Case, device_kind: str, engines) -> dict:
  """{engine: KernelConfig}: the tuner's config for the op of this shape in its group (its cached
  verdict, else the fit model's; nothing is measured here), else the group's first tl
  first-call candidate (what a first call times; the default config's 8 movers are far from it
  in groups of 4 and 8), with each engine (the Gluon one with Gluon movers where the pick is a
  tl config)."""
  from jax_autooverlap.tuning import select
  from jax_autooverlap.tuning.config import OverlapConfig
  dtype, out_dtype, w = np_dtype(case.dtype), np_dtype(case.out_dtype), case.world
  if case.op == "ag":
    v = select.choose_ag(OverlapConfig(autotune=False), device_kind, w, case.m // w, case.k,
                         case.n // w, dtype, out_dtype)
  else:
    v = select.choose_rs(OverlapConfig(autotune=False), device_kind, w, case.m, case.k // w,
                         case.n, dtype, out_dtype)
  fixed = select.default_candidates(case.op, w, dtype, select.GLUON_CAPABILITY, out_dtype)
  first = lambda engine: next((c for c in fixed if c.engine == engine), None)
  base = v.kernel or first("tl") or select.default_kernel(dtype, out_dtype, case.op)
  # a tl pick's movers are CTAs, the Gluon engine's are warps: where the tuner picked tl, the
  # Gluon variant takes the chunks and movers of the group's first Gluon first-call candidate
  gluon = first("gluon")
  out = {}
  for engine in engines:
    try:
      cfg = select.wide_output_tiles(dataclasses.replace(base, engine=engine), out_dtype,
                                     case.op)
      if engine == "gluon" and base.engine != "gluon" and gluon is not None:
        cfg = dataclasses.replace(cfg, chunks=gluon.chunks, num_comm=gluon.num_comm)
    except ValueError as e:  # the tuner's tiles do not fit this engine
      log(f"{case.op} {case.label}: engine {engine} skipped: {e}")
      continue
    # rows per GPU (ag: its shard; rs: its output rows), then the local GEMM's K and N
    why = select.unsupported(case.m // w, case.local_gemm[1], case.local_gemm[2], dtype,
                             out_dtype, cfg, case.op)
    if why is None:
      out[engine] = cfg
    else:
      log(f"{case.op} {case.label}: engine {engine} skipped: {why}")
  return out


def max_rel_err(case: Case) -> float:
  """The largest relative error a correct contestant has: MAX_REL_ERR, or for fp8 operands the
  formats' bound (jax_autooverlap/fp8.py; the reference is the f32 product of the fp8 values)."""
  from jax_autooverlap import fp8
  if not case.fp8:
    return MAX_REL_ERR
  return fp8.gemm_tolerance(case.local_gemm[1], np_dtype(case.out_dtype),
                            partials=case.world if case.op == "rs" else 1)


def kernel_names(engine: str, op: str) -> tuple[str, ...]:
  """Substrings of the fused kernel's name in the profiler (the @jit function's name)."""
  if engine == "tl":
    return ("ag_gemm_kernel",) if op == "ag" else ("gemm_rs_kernel",)
  return (f"gluon_{op}_gemm_kernel",) if op == "ag" else ("gluon_gemm_rs_kernel",)


def variant_name(cfg) -> str:
  """A fused variant's name: its engine (gluon_wg: a consumer partition per warpgroup), then
  its tiles and split where not the default's (-k<parts>, -t<last tiles split>), -p where
  the shards are packed into the row tiles, -s<stages> where its pipeline is not the default
  3 stages.  cfg: a KernelConfig or its record's dict."""
  get = cfg.get if isinstance(cfg, dict) else lambda f, d=None: getattr(cfg, f)
  name = get("engine", "tl") + ("_wg" if get("wg_partitions", False) else "")
  if (get("block_m", 128), get("block_n", 256)) != (128, 256):
    name += f"-{get('block_m', 128)}x{get('block_n', 256)}"
  split = f"-k{get('split_k', 1)}" if get("split_k", 1) > 1 else ""
  stages = f"-s{get('num_stages', 3)}" if get("num_stages", 3) != 3 else ""
  return (name + split + (f"-t{get('split_tail', 0)}" if get("split_tail", 0) else "")
          + ("-p" if get("pack_shards", False) else "") + stages)


def first_call_variants(case: Case, device_kind: str, engines) -> dict:
  """{name: KernelConfig} of what a user's first call of this shape times where the tuner has
  no verdict for it (select's first-call candidates on sm_90, less engines not asked for; {}
  where a verdict exists), each named by variant_name plus "-c<chunks>" (AG: "m<movers>")."""
  from jax_autooverlap.tuning import select
  from jax_autooverlap.tuning.config import OverlapConfig
  dtype, out_dtype, w = np_dtype(case.dtype), np_dtype(case.out_dtype), case.world
  cc = select.GLUON_CAPABILITY if "gluon" in engines else None
  if case.op == "ag":
    v = select.choose_ag(OverlapConfig(), device_kind, w, case.m // w, case.k, case.n // w,
                         dtype, out_dtype, compute_capability=cc)
  else:
    v = select.choose_rs(OverlapConfig(), device_kind, w, case.m, case.k // w, case.n, dtype,
                         out_dtype, compute_capability=cc)
  movers = lambda c: f"m{c.num_comm}" if case.op == "ag" else ""
  return {f"{variant_name(c)}-c{c.chunks}{movers(c)}": c for c in v.candidates
          if c.engine in engines}


def fused_variants(case: Case, device_kind: str, engines, num_sms: int, movers=None,
                   first_call: bool = False, extra=()) -> dict:
  """{name: KernelConfig} of the fused variants autotuning would time for this case: the
  tuner's config on each engine, GEMM+RS on the Gluon engine with a consumer partition per
  warpgroup too, and for small shapes the narrower tiles and split-K
  (tuning/select.small_shape_configs).  movers ({engine: (count, ...)}, AG only): also each
  engine's config with each of those mover counts (tl: CTAs; gluon: CTAs with a mover warp),
  named with "-m<count>".  first_call: also every first-call candidate (first_call_variants).
  extra ((engine, {field: value}), ...: parse_variants): also each engine's config with those
  fields replaced (named as given: "tl:split_k=2,..."), where the kernel can run it."""
  from jax_autooverlap.tuning import select
  configs = kernel_configs(case, device_kind, engines)
  variants = {variant_name(c): c for c in configs.values()}
  if first_call:
    for name, cfg in first_call_variants(case, device_kind, engines).items():
      if cfg not in variants.values():
        variants[name] = cfg
  if case.op == "ag":
    for engine, cfg in configs.items():
      for count in (movers or {}).get(engine, ()):
        if count != cfg.num_comm:
          variants[f"{variant_name(cfg)}-m{count}"] = dataclasses.replace(cfg, num_comm=count)
  if case.op == "rs" and "gluon" in configs:
    variants["gluon_wg"] = dataclasses.replace(configs["gluon"], wg_partitions=True)
  if configs:
    dtype, out_dtype = np_dtype(case.dtype), np_dtype(case.out_dtype)
    _, k, n = case.local_gemm
    for cfg in select.small_shape_configs(case.op, case.world, case.m // case.world, k, n, dtype,
                                          out_dtype, next(iter(configs.values())), num_sms,
                                          tuple(configs)):
      variants.setdefault(variant_name(cfg), cfg)
  for engine, fields in extra:
    cfg = explicit_variant(case, configs, engine, fields)
    if cfg is not None and cfg not in variants.values():
      variants[f"{engine}:" + ",".join(f"{f}={int(v)}" for f, v in fields.items())] = cfg
  return variants


def with_stages(case: Case, variants: dict, stages=()) -> dict:
  """`variants` ({name: KernelConfig}) and, for each, a copy with each pipeline depth of
  `stages` (named <name>-s<depth>), where the kernel can run it (unsupported: the stages'
  shared memory); --stages."""
  out = dict(variants)
  for name, cfg in variants.items():
    for depth in stages:
      deeper = dataclasses.replace(cfg, num_stages=depth)
      if deeper in out.values():
        continue
      why = unsupported(case, deeper)
      if why:
        log(f"{case.op} {case.label}: {name} in {depth} stages skipped: {why}")
        continue
      out[f"{name}-s{depth}"] = deeper
  return out


def explicit_variant(case: Case, configs: dict, engine: str, fields: dict):
  """The engine's config (configs: kernel_configs) with `fields` replaced, its warps the
  tiles' (select.tile_warps) where the tiles change and num_warps is not given; None, after
  saying why, where the engine is not timed or the kernel cannot run it."""
  from jax_autooverlap.tuning import select
  label = f"{case.op} {case.label}: --variant {engine}:{fields}"
  if engine not in configs:
    log(f"{label} skipped: engine {engine} is not timed for this case")
    return None
  base = configs[engine]
  tiles = (fields.get("block_m", base.block_m), fields.get("block_n", base.block_n))
  if tiles != (base.block_m, base.block_n) and "num_warps" not in fields:
    fields = {**fields, "num_warps": select.tile_warps(engine, *tiles)}
  try:
    cfg = dataclasses.replace(base, **fields)
  except ValueError as e:
    log(f"{label} skipped: {e}")
    return None
  why = unsupported(case, cfg)
  if why:
    log(f"{label} skipped: {why}")
    return None
  return cfg


def unsupported(case: Case, cfg) -> str | None:
  """Why the fused kernel cannot run `cfg` as rank 0 of the case's group (what the launchers
  refuse: select.unsupported, split_k_unsupported), or None."""
  from jax_autooverlap.tuning import select
  _, k, n = case.local_gemm
  rows = case.m // case.world  # ag: a shard; rs: an owner's output rows
  return (select.unsupported(rows, k, n, np_dtype(case.dtype), np_dtype(case.out_dtype), cfg,
                             case.op)
          or select.split_k_unsupported(cfg, select.fused_tiles(case.world, rows, n, cfg), k))


def alone_case(case: Case) -> Case:
  """The case's local GEMM in a group of one: the same operands' shapes, no peers."""
  m, k, n = case.local_gemm
  return dataclasses.replace(case, m=m, k=k, n=n, world=1, spare=0)


def alone_config(case: Case, cfg):
  """The tl config `cfg` of `case` run alone (alone_case): its tiles, split and movers, the
  shards unpacked (a group of one has one shard); None, after saying why, where the kernel
  cannot run it so."""
  cfg = dataclasses.replace(cfg, pack_shards=False)
  why = unsupported(alone_case(case), cfg)
  if why:
    log(f"{case.op} {case.label}: {variant_name(cfg)} alone skipped: {why}")
    return None
  return cfg


def bench_case(case: Case, device, engines, rounds: int, calls: int, movers=None,
               first_call: bool = False, extra=(), variants: dict | None = None,
               stages=()) -> list[dict]:
  """Records of one case: gemm_alone, ours (the fastest correct fused variant: fused_variants,
  or `variants` ({name: KernelConfig}) where given, each also in the pipeline depths of
  `stages` (with_stages); its `variants_ms`: every timed variant's time), ours_tl (the
  fastest on the tl engine),
  engine_alone (the Gluon engine's GEMM alone with the tiles of the fastest Gluon variant; its
  `tiles_ms`: the engine alone with each Gluon variant's tiles and stages, "<m>x<n>[-s<stages>]"),
  engine_alone_tl (ours_tl's
  kernel alone: its config in a group of one, alone_config: the local GEMM, its tiles' and the
  call's own costs, no communication)."""
  import jax
  from jax_autooverlap.runtime import cuda
  t0 = time.monotonic()
  lb = Loopback(case, device)
  log(f"{case.op} {case.label}: operands and workspaces set up in {time.monotonic() - t0:.1f} s")
  num_sms = cuda.sm_count(device.local_hardware_id)
  if variants is None:
    variants = fused_variants(case, device.device_kind, engines, num_sms, movers, first_call,
                              extra)
  variants = with_stages(case, variants, stages)
  programs = {name: fused_program(case, cfg, num_sms) for name, cfg in variants.items()}
  # each tl variant alone (one run per distinct config), on operands of its own
  alone = {name: alone_config(case, cfg) for name, cfg in variants.items() if cfg.engine == "tl"}
  alone = {name: cfg for name, cfg in alone.items() if cfg is not None}
  alone_runs = {cfg: f"tl_alone-{i}-{variant_name(cfg)}"  # (configs may differ in chunks only)
                for i, cfg in enumerate(dict.fromkeys(alone.values()))}
  lb1 = Loopback(alone_case(case), device) if alone else None
  alone_programs = {cfg: fused_program(lb1.case, cfg, num_sms) for cfg in alone_runs}
  common.warm_compiles([(p, lb.fused_args()) for p in programs.values()]
                       + [(p, lb1.fused_args()) for p in alone_programs.values()])  # threads
  contestants, checks = {"gemm_alone": (gemm_program(case), lb.gemm_args(), None)}, {}
  engine_tiles = {}  # (block_m, block_n, stages) -> the Gluon engine's GEMM alone with those
  for name, cfg in variants.items():
    if cfg.engine == "gluon" and (cfg.block_m, cfg.block_n, cfg.num_stages) not in engine_tiles:
      tiles = (cfg.block_m, cfg.block_n, cfg.num_stages)
      engine_tiles[tiles] = f"engine_alone-{tiles_name(tiles)}"
      program = engine_program(dataclasses.replace(cfg, wg_partitions=False), num_sms,
                               out_dtype=np_dtype(case.out_dtype))
      try:
        jax.block_until_ready(program(*lb.gemm_args()))
      except Exception as e:  # noqa: BLE001 - report, keep benchmarking
        log(f"{case.op} {case.label} {engine_tiles[tiles]} failed: {type(e).__name__}: "
            f"{str(e)[:400]}")
        continue
      contestants[engine_tiles[tiles]] = (program, lb.gemm_args(), ("gluon_gemm_kernel",))
  tol = max_rel_err(case)
  for name, cfg in variants.items():
    program = programs[name]
    t0 = time.monotonic()
    try:
      checks[name] = lb.check(program)
    except Exception as e:  # noqa: BLE001 - report, keep benchmarking
      log(f"{case.op} {case.label} {name} failed: {type(e).__name__}: {str(e)[:400]}")
      continue
    ok = (checks[name]["rel_err"] <= tol and checks[name]["push_rel_err"] <= tol
          and checks[name]["bit_identical_repeat"])
    log(f"{case.op} {case.label} {name}: {checks[name]} -> {'ok' if ok else 'WRONG, not timed'}"
        f" ({time.monotonic() - t0:.1f} s: compile, reference, two calls)")
    if ok:
      contestants[name] = (program, lb.fused_args(), kernel_names(cfg.engine, case.op))
  for cfg, name in alone_runs.items():
    try:
      checks[name] = lb1.check(alone_programs[cfg])
    except Exception as e:  # noqa: BLE001 - report, keep benchmarking
      log(f"{case.op} {case.label} {name} failed: {type(e).__name__}: {str(e)[:400]}")
      continue
    ok = checks[name]["rel_err"] <= tol and checks[name]["bit_identical_repeat"]
    log(f"{case.op} {case.label} {name}: {checks[name]} -> {'ok' if ok else 'WRONG, not timed'}")
    if ok:
      contestants[name] = (alone_programs[cfg], lb1.fused_args(), kernel_names("tl", case.op))
  with timing.ClockSampler() as clocks:
    timed = timing.time_interleaved(contestants, rounds, calls)
  fastest = lambda names: min(names, key=lambda e: timed[e][0]) if names else None
  fused = fastest([e for e in variants if e in timed])
  tl = fastest([e for e in variants if e in timed and variants[e].engine == "tl"])
  gluon = fastest([e for e in variants if e in timed and variants[e].engine == "gluon"])
  records = [("gemm_alone", timed["gemm_alone"], {})]
  described = lambda e: {"engine": variants[e].engine, **checks[e],
                         "kernel": dataclasses.asdict(variants[e])}
  if tl is not None:
    records.append(("ours_tl", timed[tl], described(tl)))
    run = alone_runs.get(alone.get(tl))
    if run in timed:
      records.append(("engine_alone_tl", timed[run], {
          "engine": "tl", "alone_world": 1, **checks[run],
          "kernel": dataclasses.asdict(alone[tl])}))
  tiles = ((variants[gluon].block_m, variants[gluon].block_n, variants[gluon].num_stages)
           if gluon else None)
  if engine_tiles.get(tiles) in timed:
    records.append(("engine_alone", timed[engine_tiles[tiles]],
                    {"engine": "gluon", "tiles": tiles_name(tiles), "tiles_ms": {
                        tiles_name(t): round(timed[name][0], 4)
                        for t, name in engine_tiles.items() if name in timed}}))
  if fused is not None:
    records.append(("ours", timed[fused], {**described(fused), "variants_ms": {
        e: round(timed[e][0], 4) for e in variants if e in timed}}))
  for e in contestants:
    if e in timed and e != "gemm_alone":
      log(f"{case.op} {case.label} {e}: {timed[e][0]:.4f} ms "
          f"({timed[e][0] / timed['gemm_alone'][0]:.3f} x cuBLAS)")
  return [{"impl": impl, "median_ms": round(ms, 4), **extra, **info, **clocks.summary()}
          for impl, (ms, info), extra in records]


def tiles_name(tiles) -> str:
  """"<block_m>x<block_n>" of (block_m, block_n, stages), "-s<stages>" added where not 3."""
  return f"{tiles[0]}x{tiles[1]}" + (f"-s{tiles[2]}" if tiles[2] != 3 else "")


def trace_case(case: Case, device, calls: int = 3, extra=(), gluon: bool = True
               ) -> tuple[dict, dict]:
  """({contestant: summary}, {contestant: raw trace}) of the Gluon engine alone and the fused
  Gluon kernel on this case (gluon: the config bench_case times), and of each tl --variant in
  `extra` (parse_variants; "ours-<variant name>", kernels/tl_trace.py): the timeline of the
  last of `calls` calls (bench/timeline.py)."""
  import jax
  from jax_autooverlap.bench import timeline
  from jax_autooverlap.runtime import cuda
  lb = Loopback(case, device)
  num_sms = cuda.sm_count(device.local_hardware_id)
  runs = {}
  cfg = kernel_configs(case, device.device_kind, ["gluon"]).get("gluon") if gluon else None
  if cfg is not None:
    w = case.world
    rows = case.m // w  # ag: a shard; rs: an owner's output rows
    cols = case.n // w if case.op == "ag" else case.n
    per_source = -(-rows // cfg.block_m) * -(-cols // cfg.block_n)
    if case.op == "ag":
      kind = lambda t: "local" if t < per_source else "peer"
    else:
      kind = lambda t: "own" if t >= (w - 1) * per_source else "remote"
    runs["engine_alone"] = (engine_program(cfg, num_sms, trace=True,
                                           out_dtype=np_dtype(case.out_dtype)), lb.gemm_args(),
                            None, 1)
    runs["ours"] = (fused_program(case, cfg, num_sms, trace=True), lb.fused_args(), kind, 1)
  tl_variants = [fields for engine, fields in extra if engine == "tl"]
  configs = kernel_configs(case, device.device_kind, ["tl"]) if tl_variants else {}
  for fields in tl_variants:
    tl_cfg = explicit_variant(case, configs, "tl", fields)
    if tl_cfg is not None:
      runs[f"ours-{variant_name(tl_cfg)}"] = (fused_program(case, tl_cfg, num_sms, trace=True),
                                              lb.fused_args(), None, tl_cfg.split_k)
  summaries, raw = {}, {}
  for name, (fn, args, k, split_k) in runs.items():
    for _ in range(calls):
      _, trace = jax.block_until_ready(fn(*args))
    raw[name] = np.asarray(trace)
    summaries[name] = timeline.summarize(raw[name], k, split_k)
    log(f"{case.op} {case.label} {name} timeline: {summaries[name]}")
  return summaries, raw


def format_table(op: str, records: list[dict]) -> str:
  by_shape: dict = {}
  for r in records:
    by_shape.setdefault((r["m"], r["k"], r["n"]), {})[r["impl"]] = r
  title = "AllGather+GEMM" if op == "ag" else "GEMM+ReduceScatter"
  worlds = ",".join(sorted({str(r.get("world_size", WORLD)) for r in records}))
  lines = [f"{title} loopback (one GPU, world {worlds}), ms, device time per call (median)",
           "  ".join(f"{h:>16}" for h in ("shape MxKxN", "local GEMM", "gemm_alone", "ours",
                                           "engine", "ours_tl", "engine_alone", "ours/gemm",
                                           "tl/gemm", "engine/gemm", "tl alone/gemm",
                                           "sm MHz min"))]
  nan = {"median_ms": float("nan")}
  for (m, k, n), impls in by_shape.items():
    g, o, t, e, t1 = (impls.get(i, nan)["median_ms"] for i in (
        "gemm_alone", "ours", "ours_tl", "engine_alone", "engine_alone_tl"))
    local = "x".join(map(str, impls["gemm_alone"]["local_gemm"]))
    clock = impls["gemm_alone"].get("sm_clock_mhz_min", float("nan"))
    shape = f"{m}x{k}x{n}"
    ours = impls.get("ours", {})
    engine = variant_name(ours["kernel"]) if "kernel" in ours else ours.get("engine", "-")
    num = lambda x, digits: "-" if math.isnan(x) else f"{x:.{digits}f}"  # not measured
    lines.append("  ".join(f"{c:>16}" for c in (
        shape, local, num(g, 4), num(o, 4), engine, num(t, 4), num(e, 4), num(o / g, 3),
        num(t / g, 3), num(e / g, 3), num(t1 / g, 3), num(clock, 0))))
  return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(
      prog="python -m jax_autooverlap.bench",
      description="One GPU: the fused kernel as rank 0 of a group of --world GPUs whose peers "
                  "are buffers on the same GPU (their data and arrival counters in place), checked "
                  "against the unfused result and timed (CUPTI device time, interleaved rounds) "
                  "against cuBLAS doing the same local GEMM and the Gluon engine's GEMM alone. "
                  "Writes *-loopback.json, *-engine-alone.json and a table.")
  ap.add_argument("op", choices=["ag", "rs"],
                  help="ag: all_gather(x) @ w; rs: psum_scatter(x @ w)")
  ap.add_argument("--loopback", action="store_true", required=True,
                  help="one GPU standing in for a group of --world (this mode)")
  ap.add_argument("--world", type=int, default=WORLD,
                  help="group size the GPU stands in for: 2, 4, 8, ... (default: %(default)s)")
  ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                  help="global MxKxN of the --world-GPU op, comma-separated (default: "
                       "%(default)s)")
  ap.add_argument("--dtype", default="bfloat16",
                  help="operand dtype: bfloat16, float16, float32, or float8_e4m3fn / float8_e5m2 "
                       "(fp8 operands, bf16 product, against XLA's fp8 GEMM; default: %(default)s)")
  ap.add_argument("--out-dtype", default="", choices=["", "float32"],
                  help="the product's dtype where it is not the default (the operands', bf16 "
                       "for fp8): float32, as dot_general(..., preferred_element_type=float32)")
  ap.add_argument("--engines", default="tl,gluon",
                  help="fused-kernel engines to time, comma-separated: tl, gluon (gluon on sm_90 "
                       "only; default: %(default)s)")
  ap.add_argument("--rounds", type=int, default=5,
                  help="interleaved rounds; the time is the median over rounds (default: "
                       "%(default)s)")
  ap.add_argument("--calls", type=int, default=20,
                  help="back-to-back calls per round (default: %(default)s)")
  add_variant_arguments(ap)
  ap.add_argument("--tag", default="", help="suffix of the output file names")
  ap.add_argument("--trace", action="store_true",
                  help="also record one call's per-tile timeline of the Gluon engine alone and the "
                       "fused Gluon kernel (kernels/gluon_trace.py), and of each tl --variant "
                       "(kernels/tl_trace.py): summary JSON + raw .npz")
  ap.add_argument("--out", default="bench/results",
                  help="directory of the JSON and table (default: %(default)s)")
  return ap


def add_variant_arguments(ap: argparse.ArgumentParser):
  ap.add_argument("--first-call-candidates", action="store_true",
                  help="also time every config a user's first call would time for the shape "
                       "(where no verdict exists), named <engine>-c<chunks>[m<movers>]")
  ap.add_argument("--movers", action="append", default=[], metavar="ENGINE=N,N,...",
                  help="AG: also time ENGINE's config with each of these mover counts (tl: "
                       "CTAs, gluon: CTAs with a mover warp); repeat per engine, e.g. "
                       "--movers tl=16,32,48 --movers gluon=32,64,132")
  ap.add_argument("--stages", type=parse_stages, default=(), metavar="N,N,...",
                  help="also time every variant with each of these pipeline depths (operand "
                       "stages, 2 to 12), where its shared memory fits a CTA; named "
                       "<variant>-s<N>, e.g. --stages 4,6")
  ap.add_argument("--variant", action="append", default=[], metavar="ENGINE:FIELD=V,...",
                  help="also time ENGINE's config with these KernelConfig fields replaced "
                       "(ints; pack_shards and wg_partitions 0 or 1); where the tiles change "
                       "and num_warps is not given, the tiles' warps; repeatable, e.g. "
                       "--variant tl:block_m=128,block_n=128,pack_shards=1,split_k=4")


def parse_variants(values) -> tuple[tuple[str, dict], ...]:
  """((engine, {field: value}), ...) of --variant values "ENGINE:FIELD=V,..."."""
  from jax_autooverlap.tuning.config import KernelConfig
  allowed = {f.name for f in dataclasses.fields(KernelConfig)} - {"engine"}
  flags = {"pack_shards", "wg_partitions"}
  out = []
  for v in values:
    engine, _, spec = v.partition(":")
    items = [item.partition("=") for item in spec.split(",")] if spec else []
    if engine not in ("tl", "gluon") or not items or not all(
        name in allowed and eq and value.isdigit() and (name not in flags or value in ("0", "1"))
        for name, eq, value in items):
      raise ValueError(f"--variant {v!r}: expected ENGINE:FIELD=V,... with ENGINE tl or gluon, "
                       f"FIELD one of {sorted(allowed)} and V a non-negative int (0 or 1 for "
                       f"{' and '.join(sorted(flags))}), e.g. tl:block_n=128,split_k=4")
    out.append((engine, {name: value == "1" if name in flags else int(value)
                         for name, _, value in items}))
  return tuple(out)


def parse_stages(value: str) -> tuple[int, ...]:
  """(depth, ...) of a --stages value "N,N,..."."""
  try:
    depths = tuple(int(v) for v in value.split(","))
  except ValueError:
    depths = ()
  if not depths or not all(2 <= d <= 12 for d in depths):
    raise argparse.ArgumentTypeError(f"{value!r}: expected pipeline depths N,N,... each from 2 "
                                     "to 12, e.g. 4,6")
  return depths


def parse_movers(values) -> dict[str, tuple[int, ...]]:
  """{engine: (count, ...)} of --movers values "ENGINE=N,N,..."."""
  out = {}
  for v in values:
    engine, sep, counts = v.partition("=")
    try:
      parsed = tuple(int(c) for c in counts.split(",") if c)
    except ValueError:
      parsed = ()
    if engine not in ("tl", "gluon") or not sep or not parsed or min(parsed) < 1:
      raise ValueError(f"--movers {v!r}: expected ENGINE=N,N,... with ENGINE tl or gluon and "
                       f"positive counts, e.g. tl=16,32")
    out[engine] = parsed
  return out


def parse_args(argv):
  return parser().parse_args(argv)


def gpus_and_engines(engines_arg: str, what: str):
  """(this process's GPUs, the engines of the comma-separated list that run on them): Gluon
  only on sm_90.  No GPU: ([], []) after saying so on stderr."""
  import jax
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if not gpus:
    print(f"{what}: needs an NVIDIA GPU", file=sys.stderr)
    return [], []
  engines = [e for e in engines_arg.split(",") if e]
  if "gluon" in engines and str(getattr(gpus[0], "compute_capability", "")) != "9.0":
    log(f"engine gluon skipped: it is for sm_90, this GPU is {gpus[0].device_kind}")
    engines.remove("gluon")
  return gpus, engines


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  movers, extra = parse_movers(args.movers), parse_variants(args.variant)
  cases = [Case(args.op, *map(int, s.split("x")), dtype=args.dtype, world=args.world,
                out=args.out_dtype) for s in args.shapes.split(",")]
  gpus, engines = gpus_and_engines(args.engines, "bench --loopback")
  if not gpus:
    return 2
  gpu, versions = common.gpu_name(gpus[0]), common.versions()
  date = datetime.date.today().isoformat()
  records, timelines, raw_traces = [], [], {}
  for case in cases:
    log(f"{case.op} {case.label}: local GEMM {'x'.join(map(str, case.local_gemm))}")
    for r in bench_case(case, gpus[0], engines, args.rounds, args.calls, movers,
                        args.first_call_candidates, extra, stages=args.stages):
      records.append({"op": case.op, "m": case.m, "k": case.k, "n": case.n, "dtype": case.dtype,
                      **({"out_dtype": case.out} if case.out else {}),
                      "world_size": case.world, "mode": "loopback", "local_gemm": list(case.local_gemm),
                      **r, "gpu": gpu, "versions": versions, "date": date})
    if args.trace:
      summaries, raw = trace_case(case, gpus[0], extra=extra if "tl" in engines else (),
                                  gluon="gluon" in engines)
      for impl, summary in summaries.items():
        timelines.append({"op": case.op, "m": case.m, "k": case.k, "n": case.n, "impl": impl,
                          **summary, "gpu": gpu, "versions": versions, "date": date})
      raw_traces.update({f"{case.label}/{impl}": t for impl, t in raw.items()})
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = f"{gpu}-x1-{date}-{args.op}" + (f"-w{args.world}" if args.world != WORLD else "")
  path = out_dir / f"{stem}-loopback{args.tag}.json"
  if timelines:
    (out_dir / f"{stem}-timeline{args.tag}.json").write_text(json.dumps(timelines, indent=1))
    np.savez_compressed(out_dir / f"{stem}-timeline{args.tag}.npz", **raw_traces)
  engine = [{**r, "mode": "engine"} for r in records if r["impl"] == "engine_alone"]
  if engine:
    (out_dir / f"{stem}-engine-alone{args.tag}.json").write_text(json.dumps(engine, indent=1))
  path.write_text(json.dumps([r for r in records if r["impl"] != "engine_alone"], indent=1))
  table = format_table(args.op, records)
  path.with_suffix(".txt").write_text(table + "\n")
  print(table)
  print(f"wrote {path}")
  return 0
