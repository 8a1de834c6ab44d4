"""The Gluon engine's plain GEMM against cuBLAS, per consumer schedule and tile: one GPU.

    python -m jax_autooverlap.bench.engine [--shapes 4096x8192x4096,...] [--configs NAME,...]
                                           [--rounds 3] [--calls 10] [--out DIR]

Shapes are LOCAL GEMMs M x K x N (by default the eight of the loopback benchmark's
reference shapes: what one GPU computes in AG+GEMM and GEMM+RS).  Contestants, run
interleaved (bench/timing.py: CUPTI device time, per round the mean per call, then the
median over rounds): `gemm_alone` (XLA, cuBLAS) and the engine
(kernels/gluon_gemm.py) with each named config of CONFIGS.  Every engine config is first
checked against XLA's f32-accumulated GEMM (relative error); a wrong one is not timed.
Prints a table (ratio to cuBLAS), writes <gpu>-x1-<date>-engine<tag>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

from jax_autooverlap.bench import common, timing
from jax_autooverlap.bench.loopback.programs import engine_program, gemm_program

# (M, K, N) of one GPU: AG's [M, K] @ [K, N/2] and RS's [M, K/2] @ [K/2, N] of the reference shapes
DEFAULT_SHAPES = ["4096x8192x4096", "16384x8192x4096", "16384x8192x14336", "8192x4096x2048",
                  "4096x4096x8192", "16384x4096x8192", "16384x4096x28672", "8192x2048x4096"]
# name -> KernelConfig fields (engine="gluon").  The other schedules and variants measured
# against these (ping-pong, clusters, stream-K, ...) and why they left: docs/NOTES.md
CONFIGS = {
    "coop-128x256-s3": dict(block_m=128, block_n=256, num_warps=8, num_stages=3),
    "coop-128x128-s4": dict(block_m=128, block_n=128, num_warps=8, num_stages=4),
}
MAX_REL_ERR = 2e-2
log = common.logger("engine")


def bench_shape(m: int, k: int, n: int, configs: dict, device, rounds: int, calls: int,
                dtype="bfloat16") -> list[dict]:
  import jax
  import jax.numpy as jnp
  from jax_autooverlap.runtime import cuda
  from jax_autooverlap.tuning.config import KernelConfig
  num_sms = cuda.sm_count(device.local_hardware_id)

  def operands(seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return (jax.device_put(jax.random.normal(k1, (m, k), jnp.float32).astype(dtype), device),
            jax.device_put((jax.random.normal(k2, (k, n), jnp.float32) / k ** 0.5).astype(dtype),
                           device))
  dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  a, b = operands(m * 7 + k * 3 + n)
  contestants = {"gemm_alone": (gemm_program(), (a, b), None)}
  errors = {}
  for name, fields in configs.items():
    try:
      program = engine_program(KernelConfig(engine="gluon", **fields), num_sms)
      # checked on operands of its own: XLA may hand a contestant the freed output buffer of
      # the one before, which holds the right product of shared operands even if nothing
      # is written (seen with a diagnostic kernel that skipped its stores)
      a_check, b_check = operands(m * 7 + k * 3 + n + 1 + len(errors))
      errors[name] = common.rel_err(program(a_check, b_check), dot(a_check, b_check))
    except Exception as e:  # noqa: BLE001 - report, keep benchmarking the others
      log(f"{m}x{k}x{n} {name} failed: {type(e).__name__}: {str(e)[:300]}")
      continue
    ok = errors[name] <= MAX_REL_ERR
    log(f"{m}x{k}x{n} {name}: rel. error {errors[name]:.2e} -> {'ok' if ok else 'WRONG, not timed'}")
    if ok:
      contestants[name] = (program, (a, b), ("gluon_gemm_kernel",))
  with timing.ClockSampler() as clocks:
    timed = timing.time_interleaved(contestants, rounds, calls)
  return [{"impl": "gemm_alone" if name == "gemm_alone" else "engine_alone", "config": name,
           "kernel": configs.get(name, {}), "rel_err": errors.get(name), "median_ms": round(ms, 4),
           **info, **clocks.summary()} for name, (ms, info) in timed.items()]


def format_table(records: list[dict], names) -> str:
  by_shape: dict = {}
  for r in records:
    by_shape.setdefault(tuple(r["local_gemm"]), {})[r["config"]] = r["median_ms"]
  head = ["local MxKxN", "cuBLAS ms"] + [f"{c} /cuBLAS" for c in names] + ["sm MHz min"]
  lines = ["Gluon engine alone vs cuBLAS (one GPU), device time per call (median of rounds)",
           "  ".join(f"{h:>20}" for h in head)]
  clocks = {tuple(r["local_gemm"]): r.get("sm_clock_mhz_min", float("nan")) for r in records}
  for shape, t in by_shape.items():
    g = t["gemm_alone"]
    cells = [f"{'x'.join(map(str, shape)):>20}", f"{g:>20.4f}"]
    cells += [f"{t[c] / g:>20.3f}" if c in t else f"{'-':>20}" for c in names]
    lines.append("  ".join(cells + [f"{clocks[shape]:>20.0f}"]))
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jax_autooverlap.bench.engine")
  ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="local MxKxN, comma-separated")
  ap.add_argument("--configs", default="coop-128x256-s3,coop-128x128-s4",
                  help=f"of {', '.join(CONFIGS)}")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--calls", type=int, default=10)
  ap.add_argument("--tag", default="")
  ap.add_argument("--out", default="bench/results")
  args = ap.parse_args(sys.argv[1:] if argv is None else argv)
  names = [c for c in args.configs.split(",") if c]
  unknown = [c for c in names if c not in CONFIGS]
  if unknown:
    ap.error(f"unknown config(s) {unknown}; known: {list(CONFIGS)}")
  import jax
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if not gpus or str(getattr(gpus[0], "compute_capability", "")) != "9.0":
    print("bench.engine: needs an sm_90 NVIDIA GPU (Hopper)", file=sys.stderr)
    return 2
  gpu, versions = common.gpu_name(gpus[0]), common.versions()
  date = datetime.date.today().isoformat()
  records = []
  for s in args.shapes.split(","):
    m, k, n = map(int, s.split("x"))
    log(f"{s}: {len(names)} engine configs + cuBLAS, {args.rounds} rounds x {args.calls} calls")
    for r in bench_shape(m, k, n, {c: CONFIGS[c] for c in names}, gpus[0], args.rounds, args.calls):
      records.append({"op": "gemm", "m": m, "k": k, "n": n, "local_gemm": [m, k, n],
                      "dtype": "bfloat16", "mode": "engine", **r, "gpu": gpu, "versions": versions,
                      "date": date})
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"{gpu}-x1-{date}-engine{args.tag}.json"
  path.write_text(json.dumps(records, indent=1))
  table = format_table(records, names)
  (out / path.name.replace(".json", ".txt")).write_text(table + "\n")
  print(table)
  log(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
