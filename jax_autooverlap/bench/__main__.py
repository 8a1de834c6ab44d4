"""Benchmark the fused ops against the unfused program, the rivals and the overlap floor.

    python -m jax_autooverlap.bench --help   (every command below and its options)
    python -m jax_autooverlap.bench ag|rs [--shapes 4096x8192x8192,...] [--out bench/results]
    python -m jax_autooverlap.bench ag|rs --loopback [...]   (one GPU: bench/loopback/)
    python -m jax_autooverlap.bench shapes --loopback [...]   (the LLM shape list: bench/shapes.py)
    python -m jax_autooverlap.bench model [...]   (training step end to end: bench/model/)
    python -m jax_autooverlap.bench calibrate [...]   (the cost model: bench/calibrate.py)

ag|rs: for each shape (M x K x N global, bf16, all local GPUs on one axis) it times:
  unfused        all_gather + dot_general in shard_map (NCCL + cuBLAS)
  xla_windowed   GSPMD matmul with XLA's windowed einsum (separate process, its flags)
  pallas_mgpu    JAX's Pallas Mosaic-GPU all_gather_lhs_matmul, when importable
  ours           ao.jit with the Triton kernel (best of a few kernel configs)
  gemm_alone     the local GEMM of one device (M x K x N/world, cuBLAS)
  transfer_alone the remote bytes of one device moved GPU->GPU (copy engine)
floor = max(gemm_alone, transfer_alone).  Timing: back-to-back calls over 3
rotating fresh random input sets, after warm-up; per-call time of a batch,
median of 5 batches.  Prints a table and writes JSON records, and records the
verdicts (kernel faster or not, per shape) in the user's tuning cache, which
ao.jit reads (see tuning/select.py; --no-cache to skip).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys

from jax_autooverlap import fp8
from jax_autooverlap.bench import common
from jax_autooverlap.tuning.autotune import time_call

DEFAULT_SHAPES = ["4096x8192x8192", "16384x8192x8192", "16384x8192x28672", "8192x4096x4096",
                  "512x8192x8192", "2048x8192x8192"]
BATCHES = 5  # per-call time of a batch of back-to-back calls, median of BATCHES batches
WINDOWED_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0 "
                  "--xla_gpu_multi_streamed_windowed_einsum=true")
log = common.logger("bench")


def _inputs(mesh, m, k, n, dtype, x_spec=None, w_spec=None, seed=100, sets=3):
  """`sets` fresh random (x[m, k], w[k, n]) pairs with the given shardings; fp8: w is stored
  K-major, as w^T [n, k] (w_spec names the [k, n] dims; what fp8 GEMMs read), unscaled."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  x_spec = P("x") if x_spec is None else x_spec
  w_spec = P(None, "x") if w_spec is None else w_spec
  low = fp8.is_fp8(dtype)
  out = []
  for s in range(sets):
    k1, k2 = jax.random.split(jax.random.key(seed + s))
    x = jax.device_put(jax.random.normal(k1, (m, k), np.float32).astype(dtype),
                       NamedSharding(mesh, x_spec))
    w = jax.random.normal(k2, (n, k) if low else (k, n), np.float32)
    w = (w if low else w / np.sqrt(k)).astype(dtype)
    w = jax.device_put(w, NamedSharding(mesh, _transposed(w_spec) if low else w_spec))
    out.append((x, w))
  return out


def _transposed(spec):
  """The PartitionSpec of a 2-D array's transpose."""
  from jax.sharding import PartitionSpec as P
  dims = tuple(spec) + (None,) * (2 - len(spec))
  return P(dims[1], dims[0])


def _matmul(dtype):
  """The local matmul of the programs: x @ w, or for fp8 operands the fp8 GEMM x @ (w^T)^T into
  bf16 (XLA: cuBLASLt's fp8 GEMM)."""
  import jax.numpy as jnp
  from jax import lax
  if fp8.is_fp8(dtype):
    return lambda x, wt: lax.dot_general(x, wt, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.bfloat16)
  return lambda x, w: x @ w


def _tolerance(dtype, k: int, partials: int = 1) -> float:
  """Largest relative error of a correct result against the unfused one: 2e-2, or for fp8
  operands twice the formats' bound (both are that close to the exact product)."""
  import jax.numpy as jnp
  if not fp8.is_fp8(dtype):
    return 2e-2
  return 2 * fp8.gemm_tolerance(k, jnp.bfloat16, partials)


def _best_of(program, arg_sets, want, iters, sweep, tol=2e-2):
  """Time ao.jit(program) under each kernel config; keep the fastest correct (relative error
  at most tol), deterministic one."""
  import numpy as np

  import jax_autooverlap as ao
  best = None
  for cfg in sweep:
    fused = ao.jit(program, overlap_config=ao.OverlapConfig(impl="triton", kernel=cfg))
    try:
      got = fused(*arg_sets[0])
      err = common.rel_err(got, want)
      repeat = bool(np.array_equal(np.asarray(got), np.asarray(fused(*arg_sets[0]))))
      t = time_call(fused, arg_sets, iters, batches=BATCHES)
    except Exception as e:  # noqa: BLE001 - report, keep benchmarking
      log(f"  ours {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
      continue
    log(f"  ours {cfg.engine} chunks={cfg.chunks} comm={cfg.num_comm} "
        f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} {t:.3f} ms (rel err {err:.1e}, bit-identical repeat {repeat})")
    if err > tol or not repeat:
      log("  -> wrong or non-deterministic result, not counted")
      continue
    if best is None or t < best[0]:
      best = (t, {"kernel": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "rel_err": err})
  return best


def _unfused_and_ours(program, arg_sets, iters, sweep, label, tol=2e-2):
  """{"unfused": time, "ours": (time, config) of the best correct kernel config}, and the
  unfused result (the reference every other implementation is checked against)."""
  import jax
  unfused = jax.jit(program)
  want = unfused(*arg_sets[0])
  res = {"unfused": (time_call(unfused, arg_sets, iters, batches=BATCHES), {})}
  log(f"{label} unfused {res['unfused'][0]:.3f} ms")
  best = _best_of(program, arg_sets, want, iters, sweep, tol)
  if best is not None:
    res["ours"] = best
  return res, want


def _transfer_alone(gpus, nbytes: int, iters: int):
  """nbytes moved GPU1 -> GPU0 by XLA's device-to-device copy (the copy engine)."""
  import jax
  import jax.numpy as jnp
  src = [jax.device_put(jnp.zeros((nbytes // 2,), jnp.bfloat16) + i, gpus[1]) for i in range(3)]
  move = lambda a: jax.device_put(a, gpus[0])
  return time_call(move, [(a,) for a in src], iters, batches=BATCHES), {"bytes": nbytes}


def _gpu_mesh():
  """All local GPUs on one mesh axis "x"."""
  import jax
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  return gpus, jax.make_mesh((len(gpus),), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                             devices=gpus)


def bench_ag_shape(m, k, n, dtype_name, iters, kernel_sweep, rivals=True):
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P

  dtype = jnp.dtype(dtype_name)
  gpus, mesh = _gpu_mesh()
  world = len(gpus)
  arg_sets = _inputs(mesh, m, k, n, dtype)
  out_spec = P(None, "x")
  mm = _matmul(dtype)
  w_spec = arg_sets[0][1].sharding.spec
  ag = lambda x, w: mm(lax.all_gather(x, "x", axis=0, tiled=True), w)
  program = jax.shard_map(ag, mesh=mesh, in_specs=(P("x"), w_spec), out_specs=out_spec)
  res, want = _unfused_and_ours(program, arg_sets, iters, kernel_sweep, f"ag {m}x{k}x{n}",
                                _tolerance(dtype, k))

  # local GEMM alone: the gathered [M, K] on every device times its [K, N/world]
  xg = jax.device_put(arg_sets[0][0], NamedSharding(mesh, P()))
  gemm = jax.jit(jax.shard_map(mm, mesh=mesh, in_specs=(P(), w_spec), out_specs=out_spec))
  res["gemm_alone"] = (time_call(gemm, [(xg, s[1]) for s in arg_sets], iters, batches=BATCHES), {})
  # remote bytes of one device: (world-1) shards of [M/world, K]
  res["transfer_alone"] = _transfer_alone(gpus, (world - 1) * (m // world) * k * dtype.itemsize,
                                          iters)

  if rivals and not fp8.is_fp8(dtype):  # Pallas-MGPU's collective matmul: 16-bit operands
    try:
      from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm
      from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
      emesh = jax.make_mesh((world,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                            devices=gpus)
      best_p = None
      with jax.set_mesh(emesh):
        p_sets = [(jax.sharding.reshard(x, P("x", None)), jax.sharding.reshard(w, P(None, "x")))
                  for x, w in arg_sets]
        for tn, wg in ((128, hm.MatmulDimension.N), (128, hm.MatmulDimension.M)):
          cfg = hm.TuningConfig(tile_m=128, tile_n=tn, tile_k=64, max_concurrent_steps=4,
                                grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=8,
                                wg_dimension=wg)
          f = jax.jit(jax.shard_map(
              lambda x, w, cfg=cfg: cm.all_gather_lhs_matmul(x, w, "x", config=cfg, dtype=dtype),
              out_specs=P(None, "x"), check_vma=False))
          try:
            t = time_call(f, p_sets, iters, batches=BATCHES)
            err = common.rel_err(f(*p_sets[0]), want)
          except Exception as e:  # noqa: BLE001
            log(f"  pallas_mgpu config failed: {type(e).__name__}: {str(e)[:200]}")
            continue
          if err < 2e-2 and (best_p is None or t < best_p[0]):
            best_p = (t, {"rel_err": err, "wg_dimension": str(wg)})
      if best_p:
        res["pallas_mgpu"] = best_p
    except Exception as e:  # noqa: BLE001
      log(f"  pallas_mgpu unavailable: {type(e).__name__}: {str(e)[:200]}")
  return world, res


def bench_rs_shape(m, k, n, dtype_name, iters, kernel_sweep):
  """psum_scatter(x @ w, rows): x[M, K/world], w[K/world, N] per device -> out[M/world, N]."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import PartitionSpec as P

  dtype = jnp.dtype(dtype_name)
  gpus, mesh = _gpu_mesh()
  world = len(gpus)
  arg_sets = _inputs(mesh, m, k, n, dtype, x_spec=P(None, "x"), w_spec=P("x"), seed=200)
  mm = _matmul(dtype)
  kw = dict(mesh=mesh, in_specs=(P(None, "x"), arg_sets[0][1].sharding.spec), out_specs=P("x"))
  rs = lambda x, w: lax.psum_scatter(mm(x, w), "x", scatter_dimension=0, tiled=True)
  res, _ = _unfused_and_ours(jax.shard_map(rs, **kw), arg_sets, iters, kernel_sweep,
                             f"rs {m}x{k}x{n}", _tolerance(dtype, k // world, world))
  gemm = jax.jit(jax.shard_map(mm, **kw))  # the partial product, summed by RS
  res["gemm_alone"] = (time_call(gemm, arg_sets, iters, batches=BATCHES), {})
  # remote bytes of one device: (world-1) partial slots of [M/world, N] (fp8: bf16 partials)
  out_bytes = 2 if fp8.is_fp8(dtype) else dtype.itemsize
  res["transfer_alone"] = _transfer_alone(gpus, (world - 1) * (m // world) * n * out_bytes,
                                          iters)
  return world, res


def bench_windowed(m, k, n, dtype_name, iters, op="ag"):
  """GSPMD matmul with x row-sharded and w column-sharded (run with the windowed-einsum flags)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  _, mesh = _gpu_mesh()
  arg_sets = _inputs(mesh, m, k, n, jnp.dtype(dtype_name))
  if op == "rs":  # contracting dim sharded, result row-sharded: a reduce-scatter
    arg_sets = [(jax.device_put(x, NamedSharding(mesh, P(None, "x"))),
                 jax.device_put(w, NamedSharding(mesh, P("x")))) for x, w in arg_sets]
    f = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P("x")))
  else:
    f = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P(None, "x")))
  return time_call(f, arg_sets, iters, batches=BATCHES)


def _write_tuning_cache(path, records, dtype, op):
  """Measured verdicts for tuning/data/: the kernel where it beat the unfused program (each
  stamped with the hash of the kernel sources it was measured with)."""
  from jax_autooverlap.tuning.select import cache_key
  from jax_autooverlap.tuning.store import stamped
  by_shape = {}
  for r in records:
    by_shape.setdefault((r["m"], r["k"], r["n"], r["world_size"], r["gpu"]), {})[r["impl"]] = r
  cache = {}
  for (m, k, n, world, gpu), impls in sorted(by_shape.items()):
    key = cache_key(op, gpu.replace("-", " "), world, m, k, n, dtype)
    ours, unfused = impls.get("ours"), impls["unfused"]
    if ours is not None and ours["median_ms"] < unfused["median_ms"]:
      cache[key] = {"impl": "triton", "kernel": ours["kernel"], "ours_ms": ours["median_ms"],
                    "unfused_ms": unfused["median_ms"], "date": unfused["date"]}
    else:
      cache[key] = {"impl": "unfused", "note": "fused kernel not faster" if ours else "kernel failed",
                    "ours_ms": ours["median_ms"] if ours else None,
                    "unfused_ms": unfused["median_ms"], "date": unfused["date"]}
  cache = {key: stamped(entry) for key, entry in cache.items()}
  path.write_text(json.dumps(cache, indent=1, sort_keys=True))


def _merge_into_user_cache(new_path, op):
  """Add this run's verdicts to the user's tuning cache, which ao.jit reads (newest wins)."""
  from jax_autooverlap.tuning.store import merge, user_cache_dir
  path = user_cache_dir() / f"tuning-{op}.json"
  merge(path, json.loads(new_path.read_text()))
  log(f"tuning verdicts recorded in {path} (ao.jit reads them from the next process on)")


# AG+GEMM (chunks, movers) per engine: tl movers are CTAs of their own (they compute only after
# pushing); a gluon mover is one warp of a computing CTA, and its push rate grows with the
# mover count over NVLink (2xH200, 2026-12-01: m8 0.594 ms, m32 0.438 at 4096x8192x8192).
AG_SWEEP = {"tl": ((4, 8), (4, 16), (8, 16), (8, 32)),
            "gluon": ((4, 32), (8, 32), (8, 64), (8, 132))}


USAGE = ("usage: python -m jax_autooverlap.bench {ag,rs} [options]\n"
         "       python -m jax_autooverlap.bench {ag,rs} --loopback [options]\n"
         "       python -m jax_autooverlap.bench shapes --loopback [options]\n"
         "       python -m jax_autooverlap.bench model [options]\n"
         "       python -m jax_autooverlap.bench calibrate [options]")
COMMANDS = """
Benchmarks of jax_autooverlap; each prints a table and writes JSON records.

commands:
  ag, rs             the fused op (ag: all_gather(x) @ w, rs: psum_scatter(x @ w)) against the
                     unfused program, XLA's windowed einsum and Pallas-MGPU, with the overlap
                     floor, on all local GPUs (at least 2); records its verdicts for ao.jit
  ag, rs --loopback  one GPU: the fused kernel as rank 0 of a group of --world (2, 4, 8) whose
                     peers are buffers on the same GPU, against cuBLAS on the same local GEMM
  shapes --loopback  the same for every entry of the LLM shape list (Llama-3, Qwen2, Mixtral
                     projections at TP = 2, 4, 8), one table
  model              a Llama-style training step: jax.jit vs XLA's overlap flags vs ao.jit
  calibrate          fit the cost model to this machine

Also, each with --help: python -m jax_autooverlap.bench.engine (the Gluon engine's GEMM against
cuBLAS), .gemm_check (the cost model's GEMM time against cuBLAS), .launch_cost (host cost of a
launch). The options of each command follow."""


def parser() -> argparse.ArgumentParser:
  """The two-GPU benchmark's options (`ag` / `rs`)."""
  ap = argparse.ArgumentParser(
      prog="python -m jax_autooverlap.bench",
      description="The fused op against the unfused program, XLA's windowed einsum, Pallas-MGPU "
                  "(AG) and the overlap floor on all local GPUs (at least 2): per shape the "
                  "fastest correct kernel config of a sweep. Writes "
                  "<GPU>-x<world>-<date>-<op>.json (fields: bench/records/README.md) and the "
                  "verdicts, which ao.jit reads, into the user's tuning cache.")
  ap.add_argument("op", choices=["ag", "rs"],
                  help="ag: all_gather(x) @ w; rs: psum_scatter(x @ w)")
  ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                  help="comma-separated global matmul shapes MxKxN (M rows of x, K the contracting "
                       "dim, N columns of w; M and N divisible by the GPU count), e.g. "
                       "4096x8192x8192,8192x4096x4096 (default: %(default)s)")
  ap.add_argument("--dtype", default="bfloat16",
                  help="operand dtype: bfloat16, float16, float32, or float8_e4m3fn / float8_e5m2 "
                       "(fp8 operands with w stored K-major, a bf16 product; against XLA's fp8 "
                       "GEMM; no rivals; default: %(default)s)")
  ap.add_argument("--iters", type=int, default=20,
                  help="back-to-back calls per timed batch (default: %(default)s)")
  ap.add_argument("--out", default="bench/results",
                  help="directory of the JSON and the tuning verdicts (default: %(default)s)")
  ap.add_argument("--no-rivals", action="store_true",
                  help="time neither XLA's windowed einsum nor Pallas-MGPU")
  ap.add_argument("--no-cache", action="store_true",
                  help="do not record the verdicts in the user's tuning cache")
  ap.add_argument("--engines", default="tl,gluon",
                  help="kernel engines to sweep, comma-separated: tl, gluon (the tuner keeps the "
                       "fastest correct config; default: %(default)s)")
  ap.add_argument("--windowed-only", action="store_true", help=argparse.SUPPRESS)  # the child
  return ap


def parsers() -> list[argparse.ArgumentParser]:
  """Every command's parser, in the order --help lists them."""
  from jax_autooverlap.bench import calibrate, shapes
  from jax_autooverlap.bench.loopback import cli as loopback_cli
  from jax_autooverlap.bench.model import cli as model_cli
  return [parser(), loopback_cli.parser(), shapes.parser(), model_cli.parser(),
          calibrate.parser()]


def full_help() -> str:
  return "\n\n".join([USAGE + "\n" + COMMANDS] + [p.format_help() for p in parsers()])


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] in (["-h"], ["--help"]):
    print(full_help())
    return 0
  if not argv:
    print(USAGE + "\n(python -m jax_autooverlap.bench --help: every command and option)",
          file=sys.stderr)
    return 2
  if argv[:1] == ["calibrate"]:
    from jax_autooverlap.bench import calibrate
    return calibrate.main(argv[1:])
  if argv[:1] == ["shapes"]:
    from jax_autooverlap.bench import shapes
    return shapes.main(argv[1:])
  if argv[:1] == ["model"]:
    from jax_autooverlap.bench import model
    return model.main(argv[1:])
  if "--loopback" in argv:
    from jax_autooverlap.bench import loopback
    return loopback.main(argv)
  ap = parser()
  args = ap.parse_args(argv)
  shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]

  if args.windowed_only:  # child process: XLA flags are process-wide
    print(json.dumps({f"{m}x{k}x{n}": bench_windowed(m, k, n, args.dtype, args.iters, args.op)
                      for m, k, n in shapes}))
    return 0

  import jax
  from jax_autooverlap.tuning.config import KernelConfig
  from jax_autooverlap.tuning.select import default_kernel
  if sum(d.platform == "gpu" for d in jax.devices()) < 2:
    print("bench: needs at least 2 NVIDIA GPUs", file=sys.stderr)
    return 2
  base = default_kernel(args.dtype)
  engines = [e for e in args.engines.split(",") if e]
  sweep = [KernelConfig(**{**base.__dict__, "chunks": c, "num_comm": nc, "engine": e})
           for e in engines for c, nc in AG_SWEEP[e]]
  rs_sweep = [KernelConfig(**{**base.__dict__, "chunks": c, "engine": e})
              for e in engines for c in (4, 16)]
  date = datetime.date.today().isoformat()
  gpu, versions = common.gpu_name(), common.versions()
  records, windowed = [], {}
  if not args.no_rivals and not fp8.is_fp8(args.dtype):
    log("xla_windowed (separate process)")
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + WINDOWED_FLAGS))
    proc = subprocess.run([sys.executable, "-m", "jax_autooverlap.bench", args.op, "--windowed-only",
                           "--shapes", args.shapes, "--dtype", args.dtype, "--iters",
                           str(args.iters)], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode == 0:
      windowed = json.loads(proc.stdout.strip().splitlines()[-1])
    else:
      log(f"xla_windowed failed: {proc.stderr[-500:]}")
  rows = []
  for m, k, n in shapes:
    if args.op == "ag":
      world, res = bench_ag_shape(m, k, n, args.dtype, args.iters, sweep, rivals=not args.no_rivals)
    else:
      world, res = bench_rs_shape(m, k, n, args.dtype, args.iters, rs_sweep)
    if f"{m}x{k}x{n}" in windowed:
      res["xla_windowed"] = (windowed[f"{m}x{k}x{n}"], {"xla_flags": WINDOWED_FLAGS})
    floor = max(res["gemm_alone"][0], res["transfer_alone"][0])
    for impl, (ms, extra) in res.items():
      records.append({"op": args.op, "m": m, "k": k, "n": n, "dtype": args.dtype, "world_size": world,
                      "impl": impl, "median_ms": round(ms, 4), "gpu": gpu, "versions": versions,
                      "date": date, "floor_ms": round(floor, 4), **extra})
    get = lambda i: res[i][0] if i in res else float("nan")
    rows.append((f"{m}x{k}x{n}", get("unfused"), get("xla_windowed"), get("pallas_mgpu"),
                 get("ours"), get("gemm_alone"), get("transfer_alone"), floor,
                 get("ours") / floor, get("unfused") / get("ours")))
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / f"{gpu}-x{world}-{date}-{args.op}.json"
  path.write_text(json.dumps(records, indent=1))
  _write_tuning_cache(out_dir / f"tuning-{args.op}.json", records, args.dtype, args.op)
  if not args.no_cache:
    _merge_into_user_cache(out_dir / f"tuning-{args.op}.json", args.op)
  head = ("shape MxKxN", "unfused", "xla_win", "pallas", "ours", "gemm", "xfer", "floor",
          "ours/floor", "speedup")
  title = "AllGather+GEMM" if args.op == "ag" else "GEMM+ReduceScatter"
  print(f"{title}, {args.dtype}, {world}x {gpu}, ms (median of 5 batches of {args.iters})")
  print("  ".join(f"{h:>11}" for h in head))
  for r in rows:
    print("  ".join([f"{r[0]:>11}"] + [f"{v:>11.3f}" for v in r[1:]]))
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
