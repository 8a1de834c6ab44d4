"""The PTX of every shipped kernel configuration, for proving a refactoring changed no kernel.

    PYTHONPATH=$PWD python tests/ptx_dump.py OUT_DIR [-k SUBSTRING]
    python tests/ptx_dump.py --compare DIR_BEFORE DIR_AFTER

Compile only (no GPU): each case is lowered as tests/test_kernel_compile.py lowers it
(jax.export for cuda, compute capability 90, jax-triton's dump directory) and its PTX is
written to OUT_DIR/<case>.ptx, the case's name spelling out op, dtype, config, world and
shape.  The cases: AG+GEMM (with and without the gathered output) and GEMM+RS, each config
the tuner can return (select.default_kernel for bf16, f16, f32 and fp8 e4m3, every shipped
verdict with impl "triton", each 16-bit and fp8 one on both engines, GEMM+RS on gluon with
and without warpgroup partitions), worlds 2, 4 and 8, a large and a ragged shape; fp8 also
with e5m2 x e4m3 operands (the backward's); every other config a first-call measurement may
time (`candidate_configs`: the fixed candidates of each group size, the shipped cost models'
ranked configs at the group sizes they were fit on), at its group size, the large shape; the
Gluon engine's GEMM alone (backends/gluon.launch_gemm, the benchmarks' configs); the timeline
builds (trace=True: the Gluon kernels' and the tl kernels'); the loopback set-up kernel; and every config that an entry of the
benchmark's shape list selects for small shapes (select.small_shape_configs: narrower tiles on
both engines, split-K on tl), at the first entry that selects it; and one config per kind
that a first call times for a float32 product of bf16 or fp8 operands (`wide_output_configs`).

--compare diffs two dumps without their debug information (.loc/.file directives, the
DWARF sections and their $L__tmp/$L__func labels, which follow source line numbers) and
exits 0 iff every case is in both and identical.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import pathlib
import re
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
WORLDS = (2, 4, 8)
# local shapes: AG+GEMM a[m, K] @ b[K, N]; GEMM+RS a[M, K] @ b[K, N] (M divisible by 8)
SHAPES = {"ag": {"large": (2048, 8192, 4096), "ragged": (300, 1024, 640)},
          "rs": {"large": (4096, 4096, 8192), "ragged": (600, 1024, 640)}}
GEMM_SHAPES = {"large": (4096, 8192, 4096), "ragged": (1000, 1024, 1000)}
# the engine benchmark's configs (bench/engine.py CONFIGS), on the Gluon engine
GEMM_CONFIGS = (dict(block_m=128, block_n=256, num_stages=3),
                dict(block_m=128, block_n=128, num_stages=4),
                dict(block_m=64, block_n=256, num_warps=4, num_stages=3),
                dict(block_m=64, block_n=128, num_warps=4, num_stages=3))


def _cfg_name(cfg) -> str:
  return (f"{cfg.engine}-{cfg.block_m}x{cfg.block_n}x{cfg.block_k}-g{cfg.group_m}"
          f"-w{cfg.num_warps}-s{cfg.num_stages}-c{cfg.chunks}-m{cfg.num_comm}"
          + ("-wg" if cfg.wg_partitions else "") + (f"-k{cfg.split_k}" if cfg.split_k > 1 else "")
          + (f"-t{cfg.split_tail}" if cfg.split_tail else "") + ("-p" if cfg.pack_shards else ""))


def tuner_configs(op: str) -> list:
  """(dtype name, KernelConfig) the tuner can return for op ("ag" | "rs")."""
  import jax.numpy as jnp
  import numpy as np
  from jax_autooverlap.tuning import select, store
  from jax_autooverlap.tuning.config import KernelConfig
  out = {(np.dtype(d).name, select.default_kernel(d)) for d in (jnp.bfloat16, jnp.float16,
                                                                np.float32, jnp.float8_e4m3fn)}
  for key, entry in store.shipped_entries().items():  # stale or not: re-measured, they may return
    if entry.get("impl") == "triton" and key.startswith(op + "|"):
      out.add((key.split("|")[-1], KernelConfig(**entry["kernel"])))
  for dtype, cfg in list(out):
    if np.dtype(jnp.dtype(dtype)).itemsize <= 2:
      for engine in ("tl", "gluon"):
        out.add((dtype, dataclasses.replace(cfg, engine=engine)))
        if op == "rs" and engine == "gluon":
          out.add((dtype, dataclasses.replace(cfg, engine=engine, wg_partitions=True)))
  return sorted(out, key=str)


def candidate_configs() -> list:
  """(op, dtype name, KernelConfig, world) of every config a first-call measurement may time
  that tuner_configs does not list: select.default_candidates of each group size (sm_90, bf16,
  f32 and fp8 e4m3), and the configs the shipped cost models rank (select.candidate_configs) at the
  group sizes and dtypes they were fit on."""
  import json
  import jax.numpy as jnp
  import numpy as np
  from jax_autooverlap.tuning import model as cost_model
  from jax_autooverlap.tuning import select, store
  out = set()
  for op in ("ag", "rs"):
    for world in WORLDS:
      for dtype in (jnp.bfloat16, np.float32, jnp.float8_e4m3fn):
        out |= {(op, np.dtype(dtype).name, c, world)
                for c in select.default_candidates(op, world, dtype, select.GLUON_CAPABILITY)}
    for path in sorted(store.DATA.glob("model_*.json")):
      params = json.loads(path.read_text())
      for group in params.get("groups", {}):
        world, dtype = int(group.split("|")[0][1:]), group.split("|")[1]
        model = cost_model.from_params(params, world, dtype)
        out |= {(op, dtype, c, world) for c in select.candidate_configs(op, model, dtype)}
    listed = set(tuner_configs(op))
    out = {c for c in out if c[0] != op or (c[1], c[2]) not in listed}
  return sorted(out, key=str)


def list_configs() -> list:
  """(op, dtype name, KernelConfig, world, local shape (rows of a[rows, K], K, N)) of every
  first-call candidate that an entry of the shape list (jax_autooverlap/bench/data/
  llm_shapes.json) adds for small shapes (select.small_shape_configs: narrower tiles on both
  engines, split-K and packed shards on tl; as select.first_call_candidates proposes them on
  sm_90 for bf16 and fp8 e4m3, with the H200 model and without one), at the first entry that
  selects it: what the compile tests check."""
  import jax.numpy as jnp
  import numpy as np
  from jax_autooverlap import fp8
  from jax_autooverlap.bench import shapes
  from jax_autooverlap.tuning import model as cost_model
  from jax_autooverlap.tuning import select
  out, seen = [], set()
  for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
    name = np.dtype(dtype).name
    out_dtype = jnp.bfloat16
    for e in shapes.load():
      case = e.case(name)
      w, (m, k, n) = case.world, case.local_gemm
      rows = m // w
      sizes = (rows, k, n) if e.op == "ag" else (m, k, n)
      if select.unsupported(rows, k, n, dtype, out_dtype, select.default_kernel(dtype), e.op):
        continue
      # the bf16 model orders the tl candidates of both (fp8 has none of its own)
      for model in (None, cost_model.load("NVIDIA H200", w, jnp.bfloat16)):
        fixed = set(select.default_candidates(e.op, w, dtype, select.GLUON_CAPABILITY))
        cands, _ = select.first_call_candidates(e.op, model, w, sizes, rows, dtype, out_dtype,
                                                select.GLUON_CAPABILITY)
        base = select.default_kernel(dtype) if not cands else next(
            (c for c in cands if c.engine == "tl"), cands[0])
        # the packed configs the loopback benchmark times (a first call keeps MAX_CANDIDATES)
        packed = [c for c in select.small_shape_configs(e.op, w, rows, k, n, dtype, out_dtype,
                                                        base) if c.pack_shards]
        for cfg in list(cands) + packed:
          small = (cfg.block_m, cfg.block_n) != (128, 256) or cfg.split_k > 1 or cfg.pack_shards
          if small and cfg not in fixed and (e.op, name, cfg, w) not in seen:
            seen.add((e.op, name, cfg, w))
            rows_a = case.a_shape[0]
            out.append((e.op, name, cfg, w, (rows_a, k, n)))
  assert all(fp8.is_fp8(d) or d == "bfloat16" for _, d, _, _, _ in out)
  return out


def wide_output_configs() -> list:
  """(op, dtype name, KernelConfig, world, local shape) of the configs a first call times for a
  4-byte product (preferred_element_type=float32) of bf16 or fp8 e4m3 operands, one per kind
  of config (select.small_class: engine, tiles, split, packing), at the first entry of the
  shape list that selects it (with the H200 model and without one, as list_configs): the
  kernels' float32 output tile, pushes and sums, on both engines."""
  import jax.numpy as jnp
  import numpy as np
  from jax_autooverlap.bench import shapes
  from jax_autooverlap.tuning import model as cost_model
  from jax_autooverlap.tuning import select
  out, seen = [], set()
  for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
    name = np.dtype(dtype).name
    for e in shapes.load():
      case = e.case()
      w, (m, k, n) = case.world, case.local_gemm
      rows = m // w
      sizes = (rows, k, n) if e.op == "ag" else (m, k, n)
      for model in (None, cost_model.load("NVIDIA H200", w, dtype)):
        cands, _ = select.first_call_candidates(e.op, model, w, sizes, rows, dtype, jnp.float32,
                                                select.GLUON_CAPABILITY)
        for cfg in cands:
          kind = (e.op, name, *select.small_class(cfg))
          if kind not in seen:
            seen.add(kind)
            out.append((e.op, name, cfg, w, case.a_shape + (case.b_shape[1],)))
  return out


def cases():
  """(name, function, argument specs) of every kernel launch to dump."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax_autooverlap import fp8
  from jax_autooverlap.backends import gluon, triton as tb
  from jax_autooverlap.tuning.config import KernelConfig
  spec = jax.ShapeDtypeStruct
  common = dict(timeout_s=1.0, num_sms=132, compute_capability=90)

  def fused(op, dtype, cfg, world, shape, launch=None, b_dtype=None, out_dtype=None, **extra):
    """fp8 operands (b_dtype: b's, if not dtype): b is [N, K], the output bf16; out_dtype: the
    output's where it is not that default."""
    m, k, n = shape
    dt = jnp.dtype(dtype)
    b_spec = spec((k, n), dt)
    if fp8.is_fp8(dt):
      b_spec = spec((n, k), jnp.dtype(b_dtype or dt))
      dt = jnp.dtype(jnp.bfloat16)
    dt = jnp.dtype(out_dtype or dt)
    if op == "ag":
      launch = launch or tb.launch_ag_gemm
      f = lambda a, b, row, rank: launch(a, b, row, rank, world=world, kernel=cfg, out_dtype=dt,
                                         **common, **extra)
    else:
      launch = launch or tb.launch_gemm_rs
      f = lambda a, b, row, rank: launch(a, b, row, rank, world=world, kernel=cfg, out_dtype=dt,
                                         **common, **extra)
    return f, (spec((m, k), jnp.dtype(dtype)), b_spec, spec((2 * (world + 1),), np.uint32),
               spec((1,), np.int32))

  for op in ("ag", "rs"):
    for dtype, cfg in tuner_configs(op):
      for world in WORLDS:
        for shape_name, shape in SHAPES[op].items():
          base = f"{op}-{dtype}-{_cfg_name(cfg)}-world{world}-{shape_name}"
          if op == "ag":
            for gathered in (False, True):
              yield (base + ("-gathered" if gathered else ""),
                     *fused(op, dtype, cfg, world, shape, return_gathered=gathered))
          else:
            yield base, *fused(op, dtype, cfg, world, shape)
          if fp8.is_fp8(dtype) and world == 2:  # the backward's e5m2 x e4m3
            yield (f"{op}-float8_e5m2xfloat8_e4m3fn-{_cfg_name(cfg)}-world{world}-{shape_name}",
                   *fused(op, jnp.float8_e5m2, cfg, world, shape, b_dtype=jnp.float8_e4m3fn,
                          **({"return_gathered": False} if op == "ag" else {})))

  for op, dtype, cfg, world in candidate_configs():
    name = f"{op}-{dtype}-{_cfg_name(cfg)}-world{world}-large-candidate"
    yield name, *fused(op, dtype, cfg, world, SHAPES[op]["large"],
                       **({"return_gathered": False} if op == "ag" else {}))

  bf16 = jnp.dtype(jnp.bfloat16)
  for op, dtype, cfg, world, shape in list_configs():
    extra = dict(return_gathered=False) if op == "ag" else {}
    yield (f"{op}-{dtype}-{_cfg_name(cfg)}-world{world}-list-{'x'.join(map(str, shape))}",
           *fused(op, dtype, cfg, world, shape, **extra))

  for op, dtype, cfg, world, shape in wide_output_configs():
    extra = dict(return_gathered=False) if op == "ag" else {}
    yield (f"{op}-{dtype}-to-float32-{_cfg_name(cfg)}-world{world}-list-"
           f"{'x'.join(map(str, shape))}",
           *fused(op, dtype, cfg, world, shape, out_dtype=np.float32, **extra))

  for dtype in (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn):
    dt = jnp.dtype(dtype)
    out = bf16 if fp8.is_fp8(dt) else dt
    for fields in GEMM_CONFIGS:
      cfg = KernelConfig(engine="gluon", **fields)
      if fp8.is_fp8(dt):
        cfg = dataclasses.replace(cfg, block_k=128)
      for shape_name, (m, k, n) in GEMM_SHAPES.items():
        f = lambda a, b, cfg=cfg, out=out: gluon.launch_gemm(a, b, kernel=cfg, out_dtype=out,
                                                             num_sms=132, compute_capability=90)
        yield (f"gemm-{dt.name}-{_cfg_name(cfg)}-{shape_name}", f,
               (spec((m, k), dt), spec((n, k) if fp8.is_fp8(dt) else (k, n), dt)))

  # timeline builds (the loopback benchmark's --trace): the Gluon launchers themselves
  gcfg = KernelConfig(engine="gluon")
  m, k, n = GEMM_SHAPES["large"]
  yield (f"gemm-bfloat16-{_cfg_name(gcfg)}-large-trace",
         lambda a, b: gluon.launch_gemm(a, b, kernel=gcfg, out_dtype=bf16, num_sms=132,
                                        compute_capability=90, trace=True),
         (spec((m, k), bf16), spec((k, n), bf16)))
  for gathered in (False, True):
    yield (f"ag-bfloat16-{_cfg_name(gcfg)}-world2-large" + ("-gathered" if gathered else "")
           + "-trace", *fused("ag", bf16, gcfg, 2, SHAPES["ag"]["large"], gluon.launch_ag_gemm,
                              return_gathered=gathered, trace=True))
  for cfg in (gcfg, dataclasses.replace(gcfg, wg_partitions=True)):
    yield (f"rs-bfloat16-{_cfg_name(cfg)}-world2-large-trace",
           *fused("rs", bf16, cfg, 2, SHAPES["rs"]["large"], gluon.launch_gemm_rs, trace=True))
  # the tl kernels' (kernels/tl_trace.py), on packed split-K configs at TP 8, M = 128
  tl_packed = KernelConfig(engine="tl", block_m=64, block_n=256, num_warps=8, pack_shards=True,
                           split_k=8, num_comm=32)
  yield (f"ag-bfloat16-{_cfg_name(tl_packed)}-world8-m128-trace",
         *fused("ag", bf16, tl_packed, 8, (16, 8192, 1280), return_gathered=False, trace=True))
  tl_packed = dataclasses.replace(tl_packed, block_m=128, block_n=128, split_k=4)
  yield (f"rs-bfloat16-{_cfg_name(tl_packed)}-world8-m128-trace",
         *fused("rs", bf16, tl_packed, 8, (128, 1792, 4096), trace=True))

  from jax_autooverlap.bench import loopback as lb
  from jax_autooverlap.bench.loopback import programs
  for world in WORLDS:  # the set-up kernel of each loopback group size
    table = spec((2 * (world + 1),), np.uint32)
    yield ("loopback-arm" + (f"-world{world}" if world != lb.WORLD else ""),
           lambda t, world=world: programs._arm(t, world, compute_capability=90), (table,))


def _kernels():
  """Every @triton.jit / @gluon.jit kernel the cases launch (their jax-triton caches)."""
  from jax_autooverlap.kernels import (ag_gemm, gemm_rs, gluon_ag_gemm, gluon_gemm,
                                       gluon_gemm_rs, loopback)
  return (ag_gemm.ag_gemm_kernel, gemm_rs.gemm_rs_kernel, gluon_ag_gemm.gluon_ag_gemm_kernel,
          gluon_gemm.gluon_gemm_kernel, gluon_gemm_rs.gluon_gemm_rs_kernel,
          loopback.loopback_arm_kernel)


def dump(out: pathlib.Path, only: str | None = None) -> int:
  import jax
  import triton
  from jax_autooverlap._compat import import_jax_triton
  import_jax_triton()
  from jax_triton import triton_lib
  out.mkdir(parents=True, exist_ok=True)
  (out / "VERSIONS").write_text(f"triton {triton.__version__}\njax {jax.__version__}\n")
  count = 0
  for name, f, specs in cases():
    if only and only not in name:
      continue
    for kernel in _kernels():  # jax-triton dumps only what it compiles
      kernel._jT_kernel_cache = {}
    with tempfile.TemporaryDirectory() as tmp:
      triton_lib._JAX_TRITON_DUMP_DIR = tmp
      jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
          jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call_ffi")])(*specs)
      (ptx,) = pathlib.Path(tmp).glob("**/*.ptx")
      (out / f"{name}.ptx").write_text(ptx.read_text())
    count += 1
    print(f"{count:4d} {name}", flush=True)
  return count


_DEBUG_LINE = re.compile(r"^\s*(\.loc\s|\$L__tmp\d+:|\$L__func_(begin|end)\d+:)")


def code_of(ptx: str) -> list[str]:
  """The PTX without its debug information: lines up to the first .file directive (the DWARF
  sections follow it), less .loc directives and the labels only DWARF refers to."""
  lines = []
  for line in ptx.splitlines():
    if line.lstrip().startswith(".file"):
      break
    if not _DEBUG_LINE.match(line):
      lines.append(line)
  return lines


def compare(before: pathlib.Path, after: pathlib.Path) -> int:
  a = {p.name for p in before.glob("*.ptx")}
  b = {p.name for p in after.glob("*.ptx")}
  differ = []
  for name in sorted(a & b):
    x, y = code_of((before / name).read_text()), code_of((after / name).read_text())
    if x != y:
      differ.append(name)
      diff = list(difflib.unified_diff(x, y, "before/" + name, "after/" + name, lineterm="", n=1))
      print("\n".join(diff[:40]) + ("\n..." if len(diff) > 40 else ""))
  for name in sorted(a - b):
    print(f"only in {before}: {name}")
  for name in sorted(b - a):
    print(f"only in {after}: {name}")
  same = len(a & b) - len(differ)
  print(f"{same} of {len(a & b)} kernels identical (debug information aside), "
        f"{len(differ)} differ; {len(a - b)} only before, {len(b - a)} only after")
  return 0 if not differ and a == b else 1


def main(argv) -> int:
  if argv[:1] == ["--compare"] and len(argv) == 3:
    return compare(pathlib.Path(argv[1]), pathlib.Path(argv[2]))
  if not argv or argv[0].startswith("-"):
    print(__doc__, file=sys.stderr)
    return 2
  # the shipped tuning data only (never a developer's own verdicts), the default engine
  os.environ["JAX_AUTOOVERLAP_CACHE_DIR"] = tempfile.mkdtemp(prefix="ao-cache-")
  os.environ.pop("JAX_AUTOOVERLAP_ENGINE", None)
  sys.path.insert(0, str(REPO))
  only = argv[argv.index("-k") + 1] if "-k" in argv else None
  n = dump(pathlib.Path(argv[0]), only)
  print(f"{n} kernels dumped to {argv[0]}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
