"""Hardware counters of the Gluon engine's GEMM against cuBLAS, outside XLA (GPU machine only).

    python3 bench/ncu_engine.py [--shapes 8192x2048x4096,...] [--out DIR]

Runs itself under `ncu` (clocks and caches left alone) in --child mode, where the engine's
kernel is launched by Triton itself (torch tensors; no jax.jit, no CUDA graphs, no XLA
autotuning, which is what kept ncu from profiling anything when it wrapped the JAX benchmark)
and cuBLAS through torch.matmul, once each per shape.  Prints one row per kernel: duration,
elapsed and active cycles, SM clock, the tensor ("shared") pipe's busy share of active cycles,
warp-state figures; writes the raw CSV.  Numbers from 2026-12-01: docs/NOTES.md.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import math
import os
import pathlib
import subprocess
import sys

SECTIONS = ["SpeedOfLight", "LaunchStats", "WarpStateStats", "SchedulerStats"]
METRICS = ["sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active"]
SHOW = {"Duration": "ns", "Elapsed Cycles": "cycles", "SM Active Cycles": "active",
        "SM Frequency": "Hz", "sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active":
        "tensor%", "Warp Cycles Per Issued Instruction": "cyc/inst", "Cluster Size": "cluster"}


def child(shapes):
  import torch
  import triton
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from jax_autooverlap._compat import SCRATCH_BYTES_PER_CTA
  from jax_autooverlap.kernels.gluon_gemm import gluon_gemm_kernel
  from jax_autooverlap.tuning.config import KernelConfig
  cfg = KernelConfig(engine="gluon")
  triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda",
                                                                   dtype=torch.int8))
  sms = torch.cuda.get_device_properties(0).multi_processor_count
  for m, k, n in shapes:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(k, n, device="cuda") / k ** 0.5).to(torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ctas = min(sms, math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n))
    trace = torch.zeros(4, device="cuda", dtype=torch.int64)
    scratch = torch.zeros(ctas * SCRATCH_BYTES_PER_CTA, device="cuda", dtype=torch.uint8)
    gluon_gemm_kernel[(ctas,)](a, b, c, trace, scratch, M=m, K=k, N=n, BLOCK_M=cfg.block_m,
                               BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                               STAGES=cfg.num_stages, NUM_CTAS=ctas, TRACE=False,
                               num_warps=cfg.num_warps)
    ref = torch.matmul(a, b)
    err = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"{m}x{k}x{n}: engine vs cuBLAS relative difference {err:.2e}", flush=True)
    if not err < 2e-2:
      raise SystemExit(f"{m}x{k}x{n}: the engine's result is wrong ({err:.2e})")


def summarise(csv_text: str) -> list[tuple[str, dict]]:
  """(kernel name, {metric: value}) per profiled kernel, in launch order."""
  rows = list(csv.reader(io.StringIO(csv_text[csv_text.index('"ID","Process ID"'):])))
  col = {name: i for i, name in enumerate(rows[0])}
  kernels = collections.OrderedDict()
  for r in rows[1:]:
    if len(r) <= col["Metric Value"] or not r[col["Metric Name"]]:
      continue  # rule rows carry no metric
    entry = kernels.setdefault(r[col["ID"]], (r[col["Kernel Name"]], {}))
    entry[1][r[col["Metric Name"]]] = r[col["Metric Value"]]
  return list(kernels.values())


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python3 bench/ncu_engine.py")
  ap.add_argument("--shapes", default="8192x2048x4096,4096x8192x4096,16384x4096x8192")
  ap.add_argument("--out", default="/tmp")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
  if args.child:
    child(shapes)
    return 0
  cmd = ["ncu", "--clock-control", "none", "--cache-control", "none", "--csv",
         "-k", "regex:gluon_gemm_kernel|nvjet|gemm"]
  for s in SECTIONS:
    cmd += ["--section", s]
  cmd += ["--metrics", ",".join(METRICS), sys.executable, __file__, "--child",
          "--shapes", args.shapes]
  print("running:", " ".join(cmd), file=sys.stderr, flush=True)
  res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=600)
  out = pathlib.Path(args.out) / "ncu-engine.csv"
  out.write_text(res.stdout)
  if res.returncode or '"ID","Process ID"' not in res.stdout:
    print(res.stdout[-3000:], res.stderr[-3000:], file=sys.stderr)
    return res.returncode or 1
  print(f"{'kernel':<44}" + "".join(f"{h:>18}" for h in SHOW.values()))
  for name, m in summarise(res.stdout):
    print(f"{name[:43]:<44}" + "".join(f"{m.get(k, '-'):>18}" for k in SHOW))
  print(f"raw: {out}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
