"""Check the cost model's GEMM time against cuBLAS (and the kernel) on real model shapes.

    python -m jax_autooverlap.bench.gemm_check [--params CALIBRATION.json] [--out DIR] [--kernel]

The shapes are the per-device GEMMs of tensor-parallel (TP=2) layers of
Llama-3 8B and 70B, the Mixtral-8x22B MLP and Qwen2-72B at 2k, 8k and 32k
tokens; those that are points of the model's fit are left out of the verdict
(listed, marked).  Each is timed as `jnp.dot` on one GPU (back-to-back calls
on fresh random inputs, like the calibration) and predicted by the model's
GEMM part (params: --params, a calibration JSON, else this GPU kind's cached
or shipped ones).  --kernel also times the fused AG kernel on one GPU (a
group of one: its GEMM alone) at 8k tokens and compares it with the model's
tile prediction (needs tile costs calibrated on one GPU).  Prints a table,
writes --out/gemm-check-<GPU kind>-<date>.json; about a minute on an H200.
--smoke: three tiny shapes on a CPU device (tests).
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import tempfile

from jax_autooverlap.bench import common

TOKENS = (2048, 8192, 32768)
# (model, hidden, ffn, qkv width) with TP=2; Mixtral: the MLP only.
MODELS = (("llama3-8b", 4096, 14336, 4096 + 2 * 1024), ("llama3-70b", 8192, 28672, 8192 + 2 * 1024),
          ("mixtral-8x22b-mlp", 6144, 16384, None), ("qwen2-72b", 8192, 29568, 8192 + 2 * 1024))
TP = 2
TOLERANCE = 0.05
log = common.logger("gemm_check")


SMOKE_SHAPES = (("smoke a", 64, 128, 64), ("smoke b", 128, 96, 64), ("smoke c", 96, 64, 128))


def shapes(smoke: bool = False):
  """[(name, M, N, K)]: per-device GEMMs of the column- (AG) and row-parallel (RS) projections."""
  if smoke:
    return list(SMOKE_SHAPES)
  out, seen = [], set()
  for tokens in TOKENS:
    for model, hidden, ffn, qkv in MODELS:
      gemms = [("gate_up", tokens, 2 * ffn // TP, hidden), ("down", tokens, hidden, ffn // TP)]
      if qkv:
        gemms = [("qkv", tokens, qkv // TP, hidden), ("o", tokens, hidden, hidden // TP)] + gemms
      for proj, m, n, k in gemms:
        if (m, n, k) not in seen:
          seen.add((m, n, k))
          out.append((f"{model} {proj} T={tokens}", m, n, k))
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m jax_autooverlap.bench.gemm_check")
  ap.add_argument("--params", help="calibration JSON (default: this GPU kind's cached/shipped)")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--out", default=None,
                  help="directory of the JSON output (default: bench/results; with --smoke a new "
                       "temporary directory)")
  ap.add_argument("--kernel", action="store_true", help="also the kernel on one GPU (8k tokens)")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes, a CPU device allowed (tests)")
  args = ap.parse_args(argv)

  import jax
  import numpy as np

  from jax_autooverlap.bench.calibrate import kernel_sweep, random_array
  from jax_autooverlap.tuning import fit as fitting
  from jax_autooverlap.tuning import model as cost_model
  from jax_autooverlap.tuning import store
  from jax_autooverlap.tuning.autotune import time_call
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if not gpus and not args.smoke:
    print("gemm_check: needs an NVIDIA GPU (or --smoke)", file=sys.stderr)
    return 2
  gpu, dtype = (gpus or jax.devices())[0], np.dtype(jax.numpy.dtype(args.dtype))
  kind = gpu.device_kind
  params = (json.loads(pathlib.Path(args.params).read_text()) if args.params
            else cost_model._all_params().get(kind))
  part = (params or {}).get("gemm", {}).get(dtype.name)
  if part is None:
    print(f"gemm_check: no GEMM parameters for {kind} {dtype.name}: run calibrate first",
          file=sys.stderr)
    return 2
  gemm = cost_model.GemmModel(tuple(map(tuple, part["points"])), part.get("bandwidth_log2", 0.6))
  fitted = {tuple(p[:3]) for p in part["points"]}
  dot = jax.jit(lambda a, b: a @ b)
  rows = []
  for i, (name, m, n, k) in enumerate(shapes(args.smoke)):
    sets = [(random_array((m, k), dtype, 2 * i + j, gpu), random_array((k, n), dtype, 1000 + 2 * i + j, gpu))
            for j in range(2)]
    ms = time_call(dot, sets)
    pred = gemm.ms(m, n, k)
    rows.append({"name": name, "m": m, "n": n, "k": k, "cublas_ms": round(ms, 5),
                 "model_ms": round(pred, 5), "error": round(pred / ms - 1, 4),
                 "in_fit": (m, n, k) in fitted})
    log(f"{i + 1} {name} {m}x{n}x{k}: cuBLAS {ms:.4f} ms, model {pred:.4f} ms")
    del sets
  kernel_rows = []
  tiles = {t: v for t, v in part.get("tiles", {}).items() if "one_gpu_call_us" in v}
  if args.kernel and not tiles:
    log("--kernel: no tile costs calibrated on one GPU in these params; kernel check skipped")
  elif args.kernel and gpus:
    kshapes = tuple((m, n, k) for _, m, n, k in shapes() if m == 8192)
    tile_shapes = tuple(tuple(map(int, t.split("x"))) for t in tiles)
    for cfg, m, n, k, ms in kernel_sweep(gpu, dtype, tiles=tile_shapes, shapes=kshapes):
      t = cost_model.tile_name(cfg)
      one = fitting.one_gpu_model(gemm, {t: cost_model.TileCost(tiles[t]["kappa"],
                                                                 tiles[t]["fixed_us"])},
                                  int(params["num_sms"]), dtype.name, tiles[t]["one_gpu_call_us"])
      pred = one.fused_ms("ag", m, k, n, cfg)
      kernel_rows.append({"tile": t, "m": m, "n": n, "k": k, "kernel_ms": round(ms, 5),
                          "model_ms": round(pred, 5), "error": round(pred / ms - 1, 4)})

  checked = [r for r in rows if not r["in_fit"]]
  within = sum(abs(r["error"]) <= TOLERANCE for r in checked)
  print(f"cuBLAS GEMM on one {kind}, {dtype.name}: model vs measured (ms), shapes not in the fit")
  print(f"{'shape':<34} {'M':>6} {'N':>6} {'K':>6} {'cuBLAS':>8} {'model':>8} {'error':>7}")
  for r in rows:
    mark = "  (in the fit)" if r["in_fit"] else ("" if abs(r["error"]) <= TOLERANCE else "  <-")
    print(f"{r['name']:<34} {r['m']:>6} {r['n']:>6} {r['k']:>6} {r['cublas_ms']:>8.4f} "
          f"{r['model_ms']:>8.4f} {r['error'] * 100:>+6.1f}%{mark}")
  print(f"{within}/{len(checked)} shapes not in the fit within +-{TOLERANCE * 100:.0f} %, median "
        f"|error| {np.median([abs(r['error']) for r in checked]) * 100:.1f} %")
  for r in kernel_rows:
    print(f"kernel {r['tile']} {r['m']}x{r['n']}x{r['k']}: {r['kernel_ms']:.4f} ms, model "
          f"{r['model_ms']:.4f} ms ({r['error'] * 100:+.1f} %)")
  out_dir = pathlib.Path(args.out or (tempfile.mkdtemp(prefix="ao-bench-gemm-check-smoke-")
                                       if args.smoke else "bench/results"))
  out = out_dir / f"gemm-check-{kind.replace(' ', '-')}-{datetime.date.today()}.json"
  store.write_json_atomic(out, {"device_kind": kind, "dtype": dtype.name,
                                 "params_source": part.get("source"), "tolerance": TOLERANCE,
                                 "within": within, "checked": len(checked), "cublas": rows,
                                 "kernel_one_gpu": kernel_rows})
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
