"""End-to-end training-step benchmark: a Llama-style decoder stack, jax.jit vs XLA's overlap vs ao.jit.

    python -m jax_autooverlap.bench model [--model llama3-8b,llama3-70b] [--tokens 4096,8192,16384]
                                          [--variants tp,fsdp] [--out bench/results] [--smoke]

The model (llama.py) trains under a full training step (train.py: value_and_grad
+ Adam).  For every configuration (model dims x tokens per step x variant) the
three implementations run the same program on the same inputs from the same
initial parameters: `jax.jit`, `jax.jit` with XLA's overlap flags (xla_flags.py),
`ao.jit`.  Each runs --warmup + --steps training steps, one synchronous step at a
time (runner.py); step time is the median of the timed steps.  The losses of the
first steps must agree with jax.jit's to bf16 tolerance (checked, flagged, exit
status 1 otherwise).  A configuration or implementation that fails is recorded
as an error row; one that does not apply (the mesh or the dims cannot be split
as the variant asks, or not one layer fits the memory) as an "n/a" row with the
reason (field `not_applicable`); the run goes on.

Without a GPU it runs on 8 virtual CPU devices (unless XLA_FLAGS sets a count);
`--smoke` runs a tiny model there in seconds and writes into a new temporary
directory unless --out names one: CPU timings show no overlap, so they stay out of
bench/results/.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import pathlib
import sys
import tempfile

from jax_autooverlap.bench import common
from jax_autooverlap.bench.model.llama import (MODELS, RunConfig, attention_impl, layers_that_fit,
                                               make_config, memory_estimate_bytes,
                                               model_flops_per_step)
from jax_autooverlap.bench.model.runner import IMPLS, loss_check, run_impl, run_impl_in_child
from jax_autooverlap.bench.model.xla_flags import (XLA_OVERLAP_FLAGS, parse_flags,
                                                   split_compiler_options)

log = common.logger("model")
H100_H200_BF16_DENSE_TFLOPS = 989.0  # the spec-sheet dense bf16 peak of both (SXM)
CPU_NOTE = ("CPU timings show no overlap gains (virtual CPU devices share the host's cores; "
            "collectives are memory copies): this run checks that everything runs and agrees")


def _cpu_devices():
  """8 virtual CPU devices where XLA_FLAGS sets no count (as the demo does): a device count of 1
  would leave nothing to shard.  Only the CPU platform reads the flag, and only when JAX starts
  its backends, so this runs before anything asks JAX for a device."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows each option's default, except None: those options' help says what happens then."""

  def _get_help_string(self, action):
    return action.help if action.default is None else super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(
      prog="python -m jax_autooverlap.bench model",
      description="End-to-end training step of a Llama-style decoder stack (Megatron tensor + "
                  "sequence parallelism in shard_map, bf16, remat'd layers under scan, Adam): "
                  "jax.jit vs jax.jit with XLA's overlap flags vs ao.jit, same inputs, one run. "
                  "Writes <GPU>-x<world>-<date>-model.json under --out and prints a table last; "
                  "progress goes to stderr.",
      formatter_class=_DefaultsFormatter)
  ap.add_argument("--model", default="llama3-8b,llama3-70b",
                  help=f"comma-separated layer dims to run, of {', '.join(MODELS)} (tiny: CPU smoke)")
  ap.add_argument("--tokens", default="4096,8192,16384",
                  help="comma-separated tokens per training step (global batch x sequence length)")
  ap.add_argument("--seq", type=int, default=4096,
                  help="sequence length; batch = tokens / seq (shorter sequences when the fsdp "
                       "variant's data parallelism needs a larger batch)")
  ap.add_argument("--variants", default="tp,fsdp",
                  help="comma-separated: tp (all devices on one tensor/sequence-parallel axis), "
                       "fsdp (weights also sharded on the contracting dim over an fsdp axis of "
                       "size --fsdp, batch data-parallel over it); skipped where the mesh or dims "
                       "do not fit")
  ap.add_argument("--fsdp", type=int, default=2, help="size of the fsdp axis in the fsdp variant")
  ap.add_argument("--layers", type=int, default=None,
                  help="decoder layers; default: as many as the memory estimate fits on one "
                       "device (--mem-gb), for every configuration of a model, capped at the "
                       "real model's depth")
  ap.add_argument("--mem-gb", type=float, default=None,
                  help="device memory budget for the layer estimate; default: the device's "
                       "allocator limit, else 0.9 x 141 GB (one H200)")
  ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, of " + ", ".join(IMPLS))
  ap.add_argument("--steps", type=int, default=10, help="timed training steps per implementation")
  ap.add_argument("--warmup", type=int, default=2,
                  help="untimed steps first (the first compiles); losses count from step 0")
  ap.add_argument("--loss-steps", type=int, default=3,
                  help="losses of the first N steps recorded and compared with jax.jit's")
  ap.add_argument("--loss-rtol", type=float, default=2e-2,
                  help="relative tolerance of that comparison (bf16)")
  ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                  help="adam: optax.adam when optax is installed, else plain JAX")
  ap.add_argument("--lr", type=float, default=1e-3, help="learning rate")
  ap.add_argument("--attention", choices=["auto", "cudnn", "xla"], default="auto",
                  help="jax.nn.dot_product_attention implementation; auto: cudnn on GPU where a "
                       "probe of it compiles, xla otherwise")
  ap.add_argument("--xla-overlap-flags", default=XLA_OVERLAP_FLAGS,
                  help="comma-separated name=value XLA flags of the jax.jit+xla_overlap variant: "
                       "jit compiler options where XLA accepts them, else XLA_FLAGS of a child "
                       "process")
  ap.add_argument("--xla-flags-via", choices=["auto", "env"], default="auto",
                  help="auto: compiler options where accepted; env: always a child process with "
                       "XLA_FLAGS")
  ap.add_argument("--peak-tflops", type=float, default=None,
                  help="per-device dense bf16 peak for MFU; default 989 on H100/H200 (spec "
                       "sheet), none (no MFU) elsewhere")
  ap.add_argument("--seed", type=int, default=0, help="seed of parameters and inputs")
  ap.add_argument("--out", default=None,
                  help="directory of the JSON file (default: bench/results; with --smoke a new "
                       "temporary directory)")
  ap.add_argument("--tag", default="",
                  help="file name suffix, <GPU>-x<world>-<date>-model-<tag>.json, so that runs "
                       "split over several calls on one day do not overwrite each other")
  ap.add_argument("--smoke", action="store_true",
                  help="seconds-long CPU check: --model tiny --tokens 256 --seq 128 --steps 2 "
                       "--warmup 1 --loss-steps 2 (each where left at its default)")
  ap.add_argument("--child-timeout", type=int, default=1800, help=argparse.SUPPRESS)
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  return ap


SMOKE = {"model": "tiny", "tokens": "256", "seq": 128, "steps": 2, "warmup": 1, "loss_steps": 2}


def _parse(argv):
  ap = parser()
  args = ap.parse_args(argv)
  if args.smoke:
    for k, v in SMOKE.items():
      if getattr(args, k) == ap.get_default(k):
        setattr(args, k, v)
  for name in args.model.split(","):
    if name not in MODELS:
      ap.error(f"--model: unknown {name!r}; known: {', '.join(MODELS)}")
  for impl in args.impls.split(","):
    if impl not in IMPLS:
      ap.error(f"--impls: unknown {impl!r}; known: {', '.join(IMPLS)}")
  if args.steps < 1 or args.warmup < 0 or args.loss_steps < 0:
    ap.error("--steps must be >= 1, --warmup and --loss-steps >= 0")
  args.xla_flag_dict = parse_flags(args.xla_overlap_flags)
  return args


def _configs(args, world, budget, not_run):
  """RunConfigs to run, in order; configurations that do not apply go to `not_run`, with why."""
  out = []
  for name in args.model.split(","):
    dims = MODELS[name]
    built = []
    for tokens in map(int, args.tokens.split(",")):
      for variant in args.variants.split(","):
        try:
          built.append(make_config(dims, args.layers or dims.max_layers, tokens, args.seq,
                                   variant, world, args.fsdp))
        except ValueError as e:
          not_run.append({"model": name, "tokens": tokens, "variant": variant,
                          "not_applicable": str(e)})
    if args.layers is None and built:
      layers = min(layers_that_fit(c, budget, args.attention_impl) for c in built)
      log(f"{name}: {layers} layers fit every configuration (estimate, "
          f"{budget / 1e9:.0f} GB budget per device)")
      if layers == 0:
        for c in built:
          not_run.append({"model": name, "tokens": c.tokens, "variant": c.variant,
                          "not_applicable": "not even one layer fits the memory estimate"})
        continue
      built = [dataclasses.replace(c, layers=layers) for c in built]
    out.extend(built)
  return out


def _base_record(c: RunConfig, impl, gpu, platform, versions, date):
  return {"bench": "model", "model": c.dims.name, "tokens": c.tokens, "world_size": c.world,
          "impl": impl, "variant": c.variant, "mesh": c.mesh_desc, "layers": c.layers,
          "seq": c.seq, "batch": c.batch, "hidden": c.dims.hidden, "ffn": c.dims.ffn,
          "heads": c.dims.heads, "kv_heads": c.dims.kv_heads, "dtype": "bfloat16",
          "gpu": gpu, "platform": platform, "versions": versions, "date": date,
          "fused": None, "skipped": None}  # ao.explain's counts, on ao.jit rows


def _table(records, platform, peak):
  head = ("model", "tokens", "variant", "mesh", "L", "impl", "step_ms", "tokens/s", "mfu",
          "vs jit", "fused/skip", "loss[0]", "loss ok")
  rows = [head]
  best_jit = {}
  for r in records:
    if r.get("step_ms") and r["impl"] != "ao.jit":
      key = (r["model"], r["tokens"], r["variant"])
      best_jit[key] = min(best_jit.get(key, math.inf), r["step_ms"])
  notes_of_rows = []  # why a row has no time: a variant that does not apply, or an error
  for r in records:
    why = ("n/a", r["not_applicable"]) if "not_applicable" in r else (
        ("ERROR", r["error"]) if "error" in r else None)
    if why:
      notes_of_rows.append(f"[{len(notes_of_rows) + 1}] {r['model']} tokens={r['tokens']} "
                           f"{r.get('variant', '-')} {r.get('impl') or ''}: "
                           f"{why[0]}: {why[1][:400]}")
      rows.append((r["model"], str(r["tokens"]), r.get("variant", "-"), r.get("mesh", "-"),
                   str(r.get("layers", "-")), r.get("impl") or "-",
                   f"{why[0]} [{len(notes_of_rows)}]", "", "", "", "", "", ""))
      continue
    best = best_jit.get((r["model"], r["tokens"], r["variant"]))
    vs = f"{best / r['step_ms']:.3f}x" if best else "-"
    fs = f"{r['fused']}/{r['skipped']}" if r.get("fused") is not None else "-"
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
    ok = {True: "yes", False: "NO"}.get(r.get("loss_agrees"),
                                        "ref" if r["impl"] == "jax.jit" else "-")
    rows.append((r["model"], str(r["tokens"]), r["variant"], r["mesh"], str(r["layers"]),
                 r["impl"], f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:.0f}", mfu, vs, fs,
                 f"{r['loss'][0]:.5f}" if r["loss"] else "-", ok))
  widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
  lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  notes = notes_of_rows + [
      "vs jit: the best jax.jit variant's step time / this step time (>1: faster)",
      f"mfu: model FLOPs (6.N.tokens + causal attention, remat not counted) / "
      f"(step time x devices x {peak} TFLOP/s)" if peak else "mfu: no peak known for "
      "this device (--peak-tflops)"]
  if platform == "cpu":
    notes.append("NOTE: " + CPU_NOTE)
  return "\n".join(lines + notes)


def main(argv=None) -> int:
  # Parameters, gradients and Adam's moments take most of an H200: let XLA's
  # allocator have 90% of it (its default is 75%) unless the user chose.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
  args = _parse(argv)
  _cpu_devices()
  import jax

  devices = jax.devices()
  platform, world = devices[0].platform, len(devices)
  args.attention_impl = attention_impl(args.attention, platform,
                                       {MODELS[m].head_dim for m in args.model.split(",")})

  if args.child:  # one implementation of one configuration; the record on stdout
    c = _configs(args, world, math.inf, [])[0]
    accepted, _ = split_compiler_options(args.xla_flag_dict)
    rec = run_impl(c, args.child, args, devices, accepted)
    rec["xla_flags_via"] = "XLA_FLAGS (child process)"
    print(json.dumps(rec))
    return 0

  stats = devices[0].memory_stats() or {}
  budget = (args.mem_gb * 1e9 if args.mem_gb else stats.get("bytes_limit") or 0.9 * 141e9)
  gpu, versions = common.gpu_name(), common.versions()
  date = datetime.date.today().isoformat()
  kind = devices[0].device_kind
  peak = args.peak_tflops or (H100_H200_BF16_DENSE_TFLOPS
                              if any(s in kind for s in ("H100", "H200")) else None)
  impls = args.impls.split(",")
  if args.xla_flags_via == "env":
    accepted, rejected = {}, dict(args.xla_flag_dict)
  else:
    accepted, rejected = split_compiler_options(args.xla_flag_dict)
  if "jax.jit+xla_overlap" in impls:
    log(f"XLA overlap flags as compiler options: {accepted or 'none'}; "
        f"through XLA_FLAGS in a child process: {rejected or 'none'}")
  log(f"{world} x {kind} ({platform}); attention {args.attention_impl}; "
      f"peak {peak or '-'} TFLOP/s; {CPU_NOTE if platform == 'cpu' else ''}")

  not_run = []
  configs = _configs(args, world, budget, not_run)
  records = [{"bench": "model", "world_size": world, "gpu": gpu, "platform": platform,
              "versions": versions, "date": date, "impl": None, **e} for e in not_run]
  for e in not_run:
    log(f"{e['model']} tokens={e['tokens']} {e['variant']}: n/a: {e['not_applicable']}")
  for c in configs:
    log(f"{c.dims.name} tokens={c.tokens} {c.variant} ({c.mesh_desc}) layers={c.layers} "
        f"seq={c.seq} batch={c.batch}: estimate "
        f"{memory_estimate_bytes(c, c.layers, args.attention_impl) / 1e9:.1f} GB per device")
    ref = None
    for impl in impls:
      rec = _base_record(c, impl, gpu, platform, versions, date)
      log(f"  {impl} ...")
      try:
        if impl == "jax.jit+xla_overlap" and rejected:
          got = run_impl_in_child(c, impl, args, {**{k: str(v) for k, v in accepted.items()},
                                                   **rejected})
        else:
          got = run_impl(c, impl, args, devices, accepted)
          if impl == "jax.jit+xla_overlap":
            got["xla_flags_via"] = "jit compiler_options"
        rec.update(got)
        flops = model_flops_per_step(c)
        rec["model_tflops_per_step"] = round(flops / 1e12, 3)
        rec["peak_tflops"] = peak
        rec["mfu"] = (round(flops / (rec["step_ms"] / 1e3 * c.world * peak * 1e12), 4)
                      if peak else None)
        if impl == "jax.jit":
          ref = rec
        loss_check(rec, ref, args.loss_rtol)
        log(f"  {impl}: {rec['step_ms']:.2f} ms/step, {rec['tokens_per_s']:.0f} tokens/s, "
            f"losses {rec['loss']}" + ("" if rec.get("loss_agrees", True) else
                                       f"  DISAGREE with jax.jit ({rec['loss_rel_diff']:.2e})"))
      except Exception as e:  # noqa: BLE001 - an error row; the other runs go on
        rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        log(f"  {impl} failed: {rec['error'][:600]}")
      if platform == "cpu":
        rec["note"] = CPU_NOTE
      records.append(rec)
      gc.collect()

  out_dir = pathlib.Path(args.out or (tempfile.mkdtemp(prefix="ao-bench-model-smoke-")
                                       if args.smoke else "bench/results"))
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / f"{gpu}-x{world}-{date}-model{'-' + args.tag if args.tag else ''}.json"
  path.write_text(json.dumps(records, indent=1))
  if "jax.jit+xla_overlap" in impls:
    print(f"jax.jit+xla_overlap flags: {args.xla_overlap_flags.replace(',', ' ')}")
  print(f"Training step, bf16, {world}x {kind}, median of {args.steps} steps after {args.warmup} "
        f"warm-up")
  print(_table(records, platform, peak))
  print(f"wrote {path}")
  disagree = [r for r in records if r.get("loss_agrees") is False]
  if disagree:
    print(f"FAIL: {len(disagree)} run(s) disagree with jax.jit's losses beyond rtol "
          f"{args.loss_rtol}", file=sys.stderr)
    return 1
  return 0
