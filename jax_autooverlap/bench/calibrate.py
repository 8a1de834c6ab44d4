"""Calibrate the cost model (tuning/model.py) on this machine.

    python -m jax_autooverlap.bench calibrate [--out bench/results] [--no-cache] [--smoke]

Single-GPU part (always, on the first GPU):
  - host dispatch floor: a trivial jitted call, back to back;
  - cuBLAS GEMM rates (jnp.dot) over a grid of (M, N, K), fresh random inputs;
  - the fused kernel's GEMM on one GPU (the AG kernel with a group of 1: no
    peers, so its tile loop alone) per tile shape on a few shapes, fitted to
    the model's per-tile-shape kappa and fixed cost against the cuBLAS rates.
Multi-GPU part (all local GPUs, when there are >= 2): per shape of a small
set, the benchmark's records (unfused program, the kernel at every config of a
small sweep, the GEMM alone, the remote bytes moved alone), and the group
parameters (collective curves, link and push bandwidth, per-chunk latency,
RS exchange, per-call costs) fitted on them (tuning/fit.py).

Writes the parameters into the user's tuning cache (model_<GPU kind>.json,
read by the planner from the next process on; --no-cache skips), and
--out/calibration-<GPU kind>-x<GPUs>-<date>.json (parameters plus every
measurement); prints tables and progress.  --smoke: tiny sizes on CPU devices
(for tests; the reference ring stands in for the kernel, the numbers mean
nothing).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import pathlib
import sys
import tempfile
import time

from jax_autooverlap.bench import common

GEMM_GRID = ((1024, 2048, 4096, 8192, 16384, 32768),  # M
             (1024, 2048, 4096, 8192, 16384, 32768),  # N
             (1024, 2048, 4096, 8192, 16384))         # K
MAX_GEMM_FLOP = 8.8e12        # skip grid GEMMs above (~12 ms each on an H200)
GEMM_BANDWIDTH_LOG2 = 0.4     # the grid's steps are 1 in log2: interpolate between neighbours
KERNEL_SHAPES = ((2048, 4096, 8192), (8192, 4096, 4096), (8192, 8192, 8192),  # M, N, K
                 (16384, 14336, 4096), (4096, 16384, 2048))
KERNEL_TILES = ((128, 256, 64), (128, 128, 64))
GROUP_SHAPES = ((2048, 8192, 8192), (8192, 4096, 4096), (16384, 8192, 8192),  # global M, K, N
                (8192, 4096, 16384), (8192, 16384, 4096), (512, 8192, 8192))
AG_SWEEP = ((4, 8), (8, 16), (8, 32))  # (chunks, movers)
RS_SWEEP = ((4, 8), (16, 8))
SMOKE = dict(grid=((64, 128), (64, 128), (64, 128)), group_shapes=((64, 128, 128),),
             ag_sweep=((2, 8),), rs_sweep=((2, 8),), num_sms=132)
log = common.logger("calibrate")


def random_array(shape, dtype, seed, sharding):
  """A standard-normal array of `dtype` (drawn in f32) placed with `sharding`."""
  import jax
  import numpy as np
  x = jax.random.normal(jax.random.key(seed), shape, np.float32).astype(dtype)
  return jax.device_put(x, sharding)


def dispatch_floor_ms(device) -> float:
  """ms per back-to-back call of a trivial jitted program on one device (host-bound)."""
  import jax
  import jax.numpy as jnp
  from jax_autooverlap.tuning.autotune import time_call
  x = jax.device_put(jnp.zeros((16,), jnp.float32), device)
  return time_call(jax.jit(lambda x: x + 1), [(x,)], iters=50)


def coarse_first(grid):
  """The grid's shapes, every other step of every dim first, then the ones in between: cut
  short anywhere, the shapes timed still cover the whole grid."""
  shapes = itertools.product(*(enumerate(axis) for axis in grid))
  return [tuple(v for _, v in s) for s in sorted(shapes, key=lambda s: sum(i % 2 for i, _ in s))]


def gemm_sweep(device, grid, dtype, max_flop=MAX_GEMM_FLOP, time_limit_s=None):
  """[(M, N, K, ms)] of jnp.dot on one device (cuBLAS on GPUs), two fresh random input sets;
  shapes left when the time limit is reached are not timed (coarse_first says which)."""
  import jax
  from jax_autooverlap.tuning.autotune import time_call
  shapes = [s for s in coarse_first(grid) if 2.0 * s[0] * s[1] * s[2] <= max_flop]
  start = time.monotonic()
  operands = {}  # (rows, cols) -> two random arrays, shared by the GEMMs that read them

  def operand(shape):
    if shape not in operands:
      operands[shape] = [random_array(shape, dtype, hash(shape) % 10_000 + i, device) for i in range(2)]
    return operands[shape]

  dot = jax.jit(lambda a, b: a @ b)
  out = []
  for i, (m, n, k) in enumerate(shapes):
    if time_limit_s is not None and time.monotonic() - start > time_limit_s:
      log(f"gemm: time limit {time_limit_s:.0f} s reached, {len(shapes) - i} grid shapes left")
      break
    a, b = operand((m, k)), operand((k, n))
    ms = time_call(dot, list(zip(a, b)))
    out.append((m, n, k, ms))
    log(f"gemm {i + 1}/{len(shapes)} {m}x{n}x{k}: {ms:.4f} ms, "
        f"{2.0 * m * n * k / (ms * 1e9):.0f} TFLOP/s")
  return out


def kernel_sweep(device, dtype, tiles=KERNEL_TILES, shapes=KERNEL_SHAPES):
  """[(KernelConfig, M, N, K, ms)] of the AG kernel with a group of one GPU (its GEMM alone)."""
  import dataclasses

  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jax_autooverlap.backends import triton as tb
  from jax_autooverlap.tuning import select
  from jax_autooverlap.tuning.autotune import time_call
  mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=[device])
  out = []
  for (bm, bn, bk), (m, n, k) in itertools.product(tiles, shapes):
    cfg = dataclasses.replace(select.default_kernel(dtype), block_m=bm, block_n=bn, block_k=bk)
    if select.unsupported(m, k, n, dtype, dtype, cfg):
      continue
    body = lambda a, b, cfg=cfg: tb.ag_gemm(a, b, axis_name="x", mesh=mesh, kernel=cfg,
                                            out_dtype=dtype, return_gathered=False, timeout_s=10.0)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
    sets = [(random_array((m, k), dtype, 7 + i, NamedSharding(mesh, P("x"))),
             random_array((k, n), dtype, 17 + i, NamedSharding(mesh, P()))) for i in range(2)]
    try:
      ms = time_call(f, sets)
    except Exception as e:  # noqa: BLE001 - the kernel part is optional: say why it is missing
      log(f"kernel {bm}x{bn}x{bk} {m}x{n}x{k} failed: {type(e).__name__}: {str(e)[:300]}")
      continue
    out.append((cfg, m, n, k, ms))
    log(f"kernel {bm}x{bn}x{bk} on one GPU {m}x{n}x{k}: {ms:.4f} ms")
  return out


def _mesh(devices):
  import jax
  return jax.make_mesh((len(devices),), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=devices)


def group_records(devices, shapes, ag_sweep, rs_sweep, dtype, gpu_name, smoke=False):
  """Benchmark records (tuning/fit.py's input) for each op and shape, every config recorded."""
  import dataclasses

  import jax
  import numpy as np
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jax_autooverlap as ao
  from jax_autooverlap.tuning import select
  from jax_autooverlap.tuning.autotune import time_call
  mesh, world = _mesh(devices), len(devices)
  date = datetime.date.today().isoformat()
  base = select.default_kernel(dtype)
  records = []
  for op, (m, k, n) in itertools.product(("ag", "rs"), shapes):
    if op == "ag":
      specs, out_spec = (P("x"), P(None, "x")), P(None, "x")
      body = lambda x, w: lax.all_gather(x, "x", axis=0, tiled=True) @ w
      gemm_specs, remote = (P(), P(None, "x")), (world - 1) * (m // world) * k
    else:
      specs, out_spec = (P(None, "x"), P("x")), P("x")
      body = lambda x, w: lax.psum_scatter(x @ w, "x", scatter_dimension=0, tiled=True)
      gemm_specs, remote = specs, (world - 1) * (m // world) * n
    program = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec)
    sets = [tuple(random_array(shape, dtype, 100 + 2 * i + j, NamedSharding(mesh, spec))
                  for j, (shape, spec) in enumerate((((m, k), specs[0]), ((k, n), specs[1]))))
            for i in range(2)]
    rec = lambda impl, ms, **extra: records.append(
        {"op": op, "m": m, "k": k, "n": n, "dtype": np.dtype(dtype).name, "world_size": world,
         "impl": impl, "median_ms": round(ms, 5), "gpu": gpu_name, "date": date,
         "source": "calibrate" + (" --smoke" if smoke else ""), **extra})
    unfused = jax.jit(program)
    want = np.asarray(unfused(*sets[0]), np.float32)
    rec("unfused", time_call(unfused, sets))
    gemm = jax.jit(jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=gemm_specs,
                                 out_specs=P(None, "x") if op == "ag" else P("x")))
    gemm_sets = [tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(st, gemm_specs))
                 for st in sets]
    rec("gemm_alone", time_call(gemm, gemm_sets))
    nbytes = remote * np.dtype(dtype).itemsize
    src = [jax.device_put(np.zeros((nbytes // 2,), np.uint16) + i, devices[1]) for i in range(2)]
    rec("transfer_alone", time_call(lambda a: jax.device_put(a, devices[0]), [(a,) for a in src]),
        bytes=nbytes)
    for chunks, movers in (ag_sweep if op == "ag" else rs_sweep):
      cfg = dataclasses.replace(base, chunks=chunks, num_comm=movers)
      oc = (ao.OverlapConfig(impl="reference", chunks=chunks) if smoke
            else ao.OverlapConfig(impl="triton", kernel=cfg))
      fused = ao.jit(program, overlap_config=oc)
      try:
        got = np.asarray(fused(*sets[0]), np.float32)
        err = common.rel_err(got, want)
        if err > 2e-2:
          raise ValueError(f"relative error {err:.2e} against the unfused program")
        ms = time_call(fused, sets)
      except Exception as e:  # noqa: BLE001 - report, keep calibrating
        log(f"{op} {m}x{k}x{n} chunks={chunks} movers={movers} failed: {type(e).__name__}: "
            f"{str(e)[:300]}")
        continue
      rec("ours", ms, kernel={f: getattr(cfg, f) for f in cfg.__dataclass_fields__})
    config = lambda r: (f" c{r['kernel']['chunks']} m{r['kernel']['num_comm']}"
                        if "kernel" in r else "")
    log(f"{op} {m}x{k}x{n}: " + ", ".join(
        f"{r['impl']}{config(r)} {r['median_ms']:.3f}" for r in records
        if (r["op"], r["m"], r["k"], r["n"]) == (op, m, k, n)))
  return records


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(
      prog="python -m jax_autooverlap.bench calibrate",
      description="Calibrate the cost model on this machine: cuBLAS GEMM rates and the kernel's "
                  "tile costs on one GPU, the group's parameters on all local GPUs (>= 2); "
                  "writes them into the user's tuning cache and a calibration JSON.")
  ap.add_argument("--dtype", default="bfloat16", help="operand dtype (default: %(default)s)")
  ap.add_argument("--out", default=None,
                  help="directory of the JSON output (default: bench/results; with --smoke a new "
                       "temporary directory)")
  ap.add_argument("--no-cache", action="store_true", help="do not write the user's tuning cache")
  ap.add_argument("--no-kernel", action="store_true", help="skip the kernel timing on one GPU")
  ap.add_argument("--single-gpu", action="store_true", help="only the single-GPU part")
  ap.add_argument("--devices", type=int, help="group size of the multi-GPU part (default: all)")
  ap.add_argument("--gemm-time-limit-s", type=float, default=150.0,
                  help="stop the GEMM grid after this long (it is timed coarse steps first; "
                       "default: %(default)s)")
  ap.add_argument("--smoke", action="store_true", help="tiny sizes, CPU devices allowed (tests)")
  return ap


def main(argv=None):
  args = parser().parse_args(argv)

  import jax
  import numpy as np

  from jax_autooverlap.tuning import fit as fitting
  from jax_autooverlap.tuning import model as cost_model
  from jax_autooverlap.tuning import store
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if not gpus and not args.smoke:
    print("calibrate: needs an NVIDIA GPU (or --smoke)", file=sys.stderr)
    return 2
  devices = (gpus or jax.devices())[:args.devices]
  dtype = np.dtype(jax.numpy.dtype(args.dtype))
  kind = devices[0].device_kind
  if gpus:
    from jax_autooverlap.runtime import cuda
    num_sms = cuda.sm_count(gpus[0].local_hardware_id)
  else:
    num_sms = SMOKE["num_sms"]  # a stand-in: CPU devices have no SMs
  date = datetime.date.today().isoformat()
  grid = SMOKE["grid"] if args.smoke else GEMM_GRID
  world = len(devices) if not args.single_gpu else 1
  log(f"{kind}: {len(devices)} device(s), {num_sms} SMs, {dtype.name}")

  floor = dispatch_floor_ms(devices[0])
  log(f"host dispatch floor {floor:.4f} ms per call")
  gemm_raw = gemm_sweep(devices[0], grid, dtype, time_limit_s=args.gemm_time_limit_s)
  # GEMMs shorter than twice the dispatch floor measured the host, not the GPU (kept in
  # the measurements, left out of the model); the smoke run keeps all (all are host-bound).
  usable = [g for g in gemm_raw if args.smoke or g[3] >= 2 * floor]
  points = tuple((m, n, k, round(2.0 * m * n * k / (ms * 1e9), 3)) for m, n, k, ms in usable)
  gemm = cost_model.GemmModel(points, GEMM_BANDWIDTH_LOG2)
  kernel_raw = [] if (args.no_kernel or not gpus) else kernel_sweep(gpus[0], dtype)
  tiles, one_gpu_call = (fitting.fit_tiles(kernel_raw, gemm, num_sms, dtype.name) if kernel_raw
                         else ({}, {}))
  source = f"calibrated on {kind} {date}" + (" (smoke)" if args.smoke else "")
  params = {"format": cost_model.FORMAT, "device_kind": kind, "num_sms": num_sms,
            "gemm": {dtype.name: {"source": source, "bandwidth_log2": GEMM_BANDWIDTH_LOG2,
                                  "points": [list(p) for p in points],
                                  **({"tiles": {t: {"kappa": round(c.kappa, 6),
                                                    "fixed_us": round(c.fixed_us, 6),
                                                    "one_gpu_call_us": round(one_gpu_call[t], 3),
                                                    "source": source + " (kernel, one GPU)"}
                                                for t, c in tiles.items()}} if tiles else {})}},
            "groups": {}}
  records = []
  if world >= 2:
    shapes = SMOKE["group_shapes"] if args.smoke else GROUP_SHAPES
    records = group_records(devices, shapes, SMOKE["ag_sweep"] if args.smoke else AG_SWEEP,
                            SMOKE["rs_sweep"] if args.smoke else RS_SWEEP, dtype,
                            kind.replace(" ", "-"), smoke=args.smoke)
    fitted = fitting.fit(records, gemm_params=params, num_sms=num_sms)[kind]
    params["groups"] = fitted["groups"]
    if not tiles:  # no kernel timing on one GPU: the tile costs come from the group fit
      params["gemm"][dtype.name]["tiles"] = fitted["gemm"][dtype.name]["tiles"]

  out_dir = pathlib.Path(args.out or (tempfile.mkdtemp(prefix="ao-bench-calibrate-smoke-")
                                       if args.smoke else "bench/results"))
  tag = f"{kind.replace(' ', '-')}-x{world}-{date}"
  path = out_dir / f"calibration-{tag}{'-smoke' if args.smoke else ''}.json"
  store.write_json_atomic(path, {**params, "measurements": {
      "dispatch_floor_ms": floor, "gemm": [list(g) for g in gemm_raw],
      "kernel_one_gpu": [[cost_model.tile_name(c), m, n, k, ms] for c, m, n, k, ms in kernel_raw],
      "records": records}})
  if not args.no_cache:
    cache = cost_model.params_path(store.user_cache_dir(), kind)
    old = json.loads(cache.read_text()) if cache.exists() else {}
    store.write_json_atomic(cache, cost_model.merge_params(old, params))
    cost_model.clear_cache()
    log(f"parameters recorded in {cache} (the planner reads them from the next process on)")

  print(f"cuBLAS GEMM on one {kind}, {dtype.name}: measured vs model (ms)")
  print(f"{'M':>6} {'N':>6} {'K':>6} {'measured':>9} {'model':>9} {'TFLOP/s':>8}")
  for m, n, k, ms in gemm_raw:
    flag = "" if (m, n, k) in {p[:3] for p in points} else "  (host-bound, not used)"
    print(f"{m:>6} {n:>6} {k:>6} {ms:>9.4f} {gemm.ms(m, n, k):>9.4f} "
          f"{2.0 * m * n * k / (ms * 1e9):>8.0f}{flag}")
  if kernel_raw:
    print("kernel GEMM on one GPU (ms) and fitted tile costs:")
    for cfg, m, n, k, ms in kernel_raw:
      print(f"  {cost_model.tile_name(cfg)} {m}x{n}x{k}: {ms:.4f}")
    for t, c in tiles.items():
      print(f"  {t}: kappa {c.kappa:.3f} (time per flop / cuBLAS's), "
            f"fixed {c.fixed_us:.2f} us/tile")
  elif gpus and not args.no_kernel:
    print("kernel GEMM on one GPU: unavailable (see the log); tile costs from the group fit, "
          "if any")
  for key, g in params["groups"].items():
    print(f"group {key}: " + ", ".join(f"{f}={v}" for f, v in g.items()
                                        if not f.endswith("collective")))
  if world < 2:
    print("one device: group parameters not calibrated (needs >= 2 GPUs)")
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
