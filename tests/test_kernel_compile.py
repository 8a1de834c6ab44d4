"""Compile-only checks of the GPU kernels on any machine (no GPU needed).

Every kernel configuration the tuner can pick, with each engine ("tl" and,
for 16-bit dtypes, the warp-specialised "gluon"), and every configuration a
first-call measurement may time, at its group size, is lowered through
jax-triton for sm_90a via jax.export; its PTX must hold the fast paths: wgmma
tensor-core instructions, TMA bulk tensor copies, and the system-scope
acquire/release operations of the cross-GPU protocol; the Gluon kernels also
register reallocation between warp groups (setmaxnreg) and the full TMA-store
completion wait before a push is released.
"""
import dataclasses
import glob
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jaxlib.gpu_triton")
gpu_triton = pytest.importorskip("jax._src.lib").gpu_triton
if gpu_triton is None or not hasattr(gpu_triton, "TritonKernel"):
  pytest.skip("jax-cuda plugin not installed: no Triton compile path", allow_module_level=True)

from jax_autooverlap import fp8  # noqa: E402
from jax_autooverlap.backends.launch import ag_grid, rs_grid, spread_rows  # noqa: E402
from jax_autooverlap.backends.triton import launch_ag_gemm, launch_gemm_rs  # noqa: E402
from jax_autooverlap.tuning import select  # noqa: E402
from jax_autooverlap.tuning.config import KernelConfig  # noqa: E402
from ptx_dump import (candidate_configs, list_configs, tuner_configs,  # noqa: E402
                      wide_output_configs)


def _tuner_configs(op):
  """(dtype, KernelConfig) pairs the tuner can return for op (tests/ptx_dump.py's list), less
  GEMM+RS's warpgroup partitions: test_gemm_rs_with_warpgroup_partitions_compiles has those."""
  return [dc for dc in tuner_configs(op) if not dc[1].wg_partitions]


_ID = lambda dc: (f"{dc[0]}-{dc[1].engine}-{dc[1].block_m}x{dc[1].block_n}x{dc[1].block_k}"
                  f"-c{dc[1].chunks}-m{dc[1].num_comm}")


def _check_dtype(ptx, dtype):
  """fp8 kernels multiply on the fp8 tensor cores (wgmma k32, e4m3 x e4m3) and scale their
  product in the epilogue; the 16-bit ones have no fp8 wgmma."""
  if fp8.is_fp8(dtype):
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx), \
        "fp8 kernel without fp8 wgmma"
  else:
    assert ".e4m3" not in ptx and ".e5m2" not in ptx


def _check_engine(ptx, cfg):
  if cfg.engine == "gluon":
    assert "setmaxnreg" in ptx, "Gluon kernel lost its warp specialisation (register reallocation)"
    threads = (cfg.num_warps + 4) * 32  # a consumer warpgroup per 64 rows + 1 worker warp group
    assert f".reqntid {threads}" in ptx, f"Gluon kernel: {threads} threads expected"
    assert "%clock64" not in ptx, "the timeline (kernels/gluon_trace.py) is built in"
  else:
    assert "setmaxnreg" not in ptx
    assert "%clock64" not in ptx, "the timeline (kernels/tl_trace.py) is built in"


def _ptx(monkeypatch, tmp_path, dtype, cfg, m, k, n, world, return_gathered, op="ag",
         b_dtype=None, out_dtype=None):
  """fp8 dtype: b (of b_dtype, default dtype) is [N, K], the output bf16; out_dtype: the
  output's where it is not that default."""
  from jax_autooverlap._compat import import_jax_triton
  import_jax_triton()
  from jax_triton import triton_lib
  monkeypatch.setattr(triton_lib, "_JAX_TRITON_DUMP_DIR", str(tmp_path))  # read at import time
  out = jnp.dtype(out_dtype or (jnp.bfloat16 if fp8.is_fp8(dtype) else dtype))
  if op == "ag":
    f = lambda a, b, row, rank: launch_ag_gemm(
        a, b, row, rank, world=world, kernel=cfg, out_dtype=out, return_gathered=return_gathered,
        timeout_s=1.0, num_sms=132, compute_capability=90)
  else:
    f = lambda a, b, row, rank: launch_gemm_rs(
        a, b, row, rank, world=world, kernel=cfg, out_dtype=out, timeout_s=1.0, num_sms=132,
        compute_capability=90)
  b_spec = (jax.ShapeDtypeStruct((n, k), jnp.dtype(b_dtype or dtype)) if fp8.is_fp8(dtype)
            else jax.ShapeDtypeStruct((k, n), dtype))
  specs = (jax.ShapeDtypeStruct((m, k), dtype), b_spec,
           jax.ShapeDtypeStruct((2 * (world + 1),), np.uint32), jax.ShapeDtypeStruct((1,), np.int32))
  jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
      jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call_ffi")])(*specs)
  files = glob.glob(str(tmp_path / "**" / "*.ptx"), recursive=True)
  if not files:  # compiled without error but not dumped: jax-triton's cache already had this
    pytest.skip("identical kernel binary already compiled and checked by another case")
  return pathlib.Path(files[0]).read_text()


def assert_scratch_is_the_operand(ptx):
  """The kernel's TMA-descriptor scratch is its last explicit parameter (an XLA buffer), never
  Triton's implicit global-scratch pointer (jaxlib would allocate that on every launch, which
  CUDA graphs cannot hold): see _compat.py."""
  entry = re.search(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S)
  params = re.findall(r"\b(\w+_param_\d+)\b", entry.group(2))
  assert f"[{params[-2]}]" not in ptx and f"[{params[-1]}]" not in ptx, "implicit scratch is read"
  # (a kernel that makes no descriptor on the device, its operands' made on the host, needs
  # no scratch: the packed tl GEMM+RS)
  made_here = "tensormap.replace" in ptx
  assert (f"[{params[-3]}]" in ptx) == made_here, "the scratch operand is not what descriptors use"


def _check_ag(ptx, cfg, dtype):
  assert "wgmma.mma_async" in ptx, "GEMM lost its tensor-core (wgmma) path"
  assert "cp.async.bulk.tensor" in ptx, "GEMM lost its TMA loads"
  assert "ld.global.acquire.sys" in ptx, "consumer lost its system-scope acquire"
  assert "sys.release" in ptx, "producer lost its system-scope release"
  assert "%globaltimer" in ptx, "waits are no longer bounded"
  if cfg.engine == "gluon":  # the mover warp pushes with TMA box copies, written before release
    assert "cp.async.bulk.tensor.3d.global.shared::cta" in ptx, "pushes are not TMA stores"
    assert "cp.async.bulk.wait_group 0;" in ptx, "no full TMA-store completion wait before release"
  else:
    assert "st.global.v4" in ptx or "st.global.v2" in ptx, "peer copies are not vectorised"
  assert_scratch_is_the_operand(ptx)
  _check_engine(ptx, cfg)
  _check_dtype(ptx, dtype)


def _check_rs(ptx, cfg, dtype):
  assert "wgmma.mma_async" in ptx, "GEMM lost its tensor-core (wgmma) path"
  assert "cp.async.bulk.tensor" in ptx, "GEMM lost its TMA loads"
  assert "ld.global.acquire.sys" in ptx, "owner lost its system-scope acquire"
  assert "ld.global.b16" not in ptx, "owner reads peers' partials element by element (not TMA)"
  assert "sys.release" in ptx, "producer lost its system-scope release"
  assert "%globaltimer" in ptx, "waits are no longer bounded"
  assert_scratch_is_the_operand(ptx)
  _check_engine(ptx, cfg)
  _check_dtype(ptx, dtype)
  if cfg.engine == "gluon":  # pushes are TMA stores: written (not only read) before the release
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx, "pushes are not TMA stores"
    assert "cp.async.bulk.wait_group 0;" in ptx, "no full TMA-store completion wait before release"


@pytest.mark.parametrize("dtype_cfg", _tuner_configs("ag"), ids=_ID)
@pytest.mark.parametrize("shape", [(2048, 8192, 4096), (300, 1024, 640)], ids=["large", "ragged"])
def test_ag_gemm_compiles_with_fast_paths(monkeypatch, tmp_path, dtype_cfg, shape):
  dtype, cfg = dtype_cfg
  m, k, n = shape
  _check_ag(_ptx(monkeypatch, tmp_path, jnp.dtype(dtype), cfg, m, k, n, world=2,
                 return_gathered=(m == 300)), cfg, dtype)


@pytest.mark.parametrize("dtype_cfg", _tuner_configs("rs"), ids=_ID)
@pytest.mark.parametrize("shape", [(4096, 4096, 8192), (600, 1024, 640)], ids=["large", "ragged"])
def test_gemm_rs_compiles_with_fast_paths(monkeypatch, tmp_path, dtype_cfg, shape):
  dtype, cfg = dtype_cfg
  m, k, n = shape
  _check_rs(_ptx(monkeypatch, tmp_path, jnp.dtype(dtype), cfg, m, k, n, world=2,
                 return_gathered=False, op="rs"), cfg, dtype)


@pytest.mark.parametrize("case", candidate_configs(),
                         ids=lambda c: f"{c[0]}-w{c[3]}-{_ID((c[1], c[2]))}")
def test_first_call_candidates_compile_at_their_group_size(monkeypatch, tmp_path, case):
  """Every config a first-call measurement may time (tests/ptx_dump.py's candidate_configs:
  the fixed candidates of groups of 2, 4 and 8, the shipped models' ranked configs), compiled
  for its group size with the fast paths."""
  op, dtype, cfg, world = case
  m, k, n = (2048, 8192, 4096) if op == "ag" else (4096, 4096, 8192)
  ptx = _ptx(monkeypatch, tmp_path, jnp.dtype(dtype), cfg, m, k, n, world=world,
             return_gathered=False, op=op)
  (_check_ag if op == "ag" else _check_rs)(ptx, cfg, dtype)


@pytest.mark.parametrize("engine", ["tl", "gluon"])
@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_kernels_compile_for_larger_groups(monkeypatch, tmp_path, world, op, engine):
  """The kernels are written for any group size: WORLD is a compile-time constant."""
  cfg = dataclasses.replace(select.default_kernel(jnp.bfloat16), engine=engine)
  ptx = _ptx(monkeypatch, tmp_path, jnp.dtype(jnp.bfloat16), cfg, 1024 if op == "ag" else 4096,
             2048, 3072, world=world, return_gathered=(op == "ag"), op=op)
  assert "wgmma.mma_async" in ptx and "ld.global.acquire.sys" in ptx and "sys.release" in ptx


def _gluon_program(kind, m, k, n, dtype=jnp.bfloat16, world=2, **launch):
  """(jitted function, argument specs) of one Gluon launch for the compile checks: kind gemm
  (the engine alone, [m, k] @ [k, n]), ag, rs or rs_wg (the fused kernels, world 2, this GPU's
  operands [m, k] and [k, n]; fp8 dtype: b is [n, k], the output bf16, K tiles of 128), with
  _64: 64-row tiles; launch: further launcher arguments."""
  from jax_autooverlap.backends import gluon
  bf16, dt = jnp.dtype(jnp.bfloat16), jnp.dtype(dtype)
  rows = dict(block_m=64, num_warps=4) if kind.endswith("_64") else {}
  kernel = KernelConfig(engine="gluon", wg_partitions=kind.endswith("_wg"),
                        block_k=128 if fp8.is_fp8(dt) else 64, **rows)
  kind = kind.removesuffix("_64")
  common = dict(kernel=kernel, out_dtype=bf16, num_sms=132, compute_capability=90, **launch)
  specs = [jax.ShapeDtypeStruct((m, k), dt),
           jax.ShapeDtypeStruct((n, k) if fp8.is_fp8(dt) else (k, n), dt)]
  if kind == "gemm":
    return (lambda a, b: gluon.launch_gemm(a, b, **common)), specs
  launch_op = gluon.launch_ag_gemm if kind == "ag" else gluon.launch_gemm_rs
  extra = dict(return_gathered=False) if kind == "ag" else {}
  f = lambda a, b, row, rank: launch_op(a, b, row, rank, world=world, timeout_s=1.0, **extra,
                                        **common)
  return f, specs + [jax.ShapeDtypeStruct((6,), np.uint32), jax.ShapeDtypeStruct((1,), np.int32)]


def _exported_ptx(monkeypatch, dump_dir, f, specs) -> str:
  """The PTX jax-triton compiles for f's one kernel (lowered for cuda via jax.export)."""
  from jax_autooverlap._compat import import_jax_triton
  import_jax_triton()
  from jax_triton import triton_lib
  monkeypatch.setattr(triton_lib, "_JAX_TRITON_DUMP_DIR", str(dump_dir))
  jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
      jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call_ffi")])(*specs)
  (ptx,) = [p.read_text() for p in pathlib.Path(dump_dir).glob("**/*.ptx")]
  return ptx


@pytest.mark.parametrize("kind", ["gemm", "ag", "rs"])
def test_gluon_kernels_build_their_timeline_only_when_asked(monkeypatch, tmp_path, kind):
  """kernels/gluon_trace.py: a trace build reads %clock64 and stores the stamps, without
  spilling (a spilling trace build times its spills: per-round stamps in GEMM+RS's own tiles
  spilled 732 bytes and read 60.7 us for a 15.5 us epilogue, docs/NOTES.md); the normal
  build (every other test here) has no clock reads."""
  f, specs = _gluon_program(kind, 2048, 1024, 768, trace=True)
  out = jax.eval_shape(f, *specs)
  assert out[1].shape[1:] == (257, 6) and out[1].dtype == np.int64
  ptx = _exported_ptx(monkeypatch, tmp_path, f, specs)
  assert "%clock64" in ptx and "%globaltimer" in ptx
  assert_scratch_is_the_operand(ptx)
  _assert_no_spills(ptx, tmp_path)


def test_tl_kernels_build_their_timeline_only_when_asked(monkeypatch, tmp_path):
  """kernels/tl_trace.py: the tl AG+GEMM's and GEMM+RS's trace builds (packed split-K configs,
  as the split sweep times them) read %clock64 and %globaltimer and return an int64
  [ctas, 257, 6] timeline without spilling (the plain builds have no clock reads:
  _check_engine)."""
  from jax_autooverlap.backends import triton as backend
  from jax_autooverlap.bench import loopback as lb
  bf16, world = jnp.dtype(jnp.bfloat16), 8
  cfg = KernelConfig(engine="tl", block_m=64, block_n=256, num_warps=8, pack_shards=True,
                     split_k=8, num_comm=32)
  f = lambda a, b, table, rank: backend.launch_ag_gemm(
      a, b, table, rank, world=world, kernel=cfg, out_dtype=bf16, return_gathered=False,
      timeout_s=1.0, num_sms=132, compute_capability=90, trace=True)
  specs = (jax.ShapeDtypeStruct((16, 1024), bf16), jax.ShapeDtypeStruct((1024, 1280), bf16),
           jax.ShapeDtypeStruct((2 * (world + 1),), np.uint32),
           jax.ShapeDtypeStruct((1,), np.int32))
  out, timeline = jax.eval_shape(f, *specs)
  assert out.shape == (128, 1280) and timeline.dtype == np.int64
  assert timeline.shape[1:] == (257, 6)
  ptx = _exported_ptx(monkeypatch, tmp_path, f, specs)
  assert "%clock64" in ptx and "%globaltimer" in ptx
  assert_scratch_is_the_operand(ptx)
  # GEMM+RS: 16 rows per owner at TP 8 (Llama-3-8B down, M = 128), packed, split 4
  rs_cfg = dataclasses.replace(cfg, block_m=128, block_n=128, split_k=4)
  g = lambda a, b, table, rank: backend.launch_gemm_rs(
      a, b, table, rank, world=world, kernel=rs_cfg, out_dtype=bf16, timeout_s=1.0, num_sms=132,
      compute_capability=90, trace=True)
  rs_specs = (jax.ShapeDtypeStruct((128, 1792), bf16), jax.ShapeDtypeStruct((1792, 4096), bf16),
              *specs[2:])
  out, timeline = jax.eval_shape(g, *rs_specs)
  assert out.shape == (16, 4096) and timeline.dtype == np.int64
  assert timeline.shape[1:] == (257, 6)
  (tmp_path / "rs").mkdir()
  ptx = _exported_ptx(monkeypatch, tmp_path / "rs", g, rs_specs)
  assert "%clock64" in ptx and "%globaltimer" in ptx
  _assert_no_spills(ptx, tmp_path)
  # the loopback program builds it too (set-up kernel, then the traced kernel)
  case = lb.Case("rs", 128, 8 * 1792, 4096, dtype="bfloat16", world=world)
  program = lb.fused_program(case, rs_cfg, 132, compute_capability=90, trace=True)
  assert jax.eval_shape(program, *rs_specs)[1].shape == timeline.shape


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fp8_loopback_programs_compile(op):
  """bench --loopback --dtype float8_e4m3fn: the fused program (fp8 operands, b K-major, bf16
  out), the Gluon engine alone and XLA's fp8 GEMM of the local work."""
  from jax_autooverlap.bench import loopback as lb
  from jax_autooverlap.bench.loopback.programs import engine_program, gemm_program
  case = lb.Case(op, 1024, 1024, 1024, dtype="float8_e4m3fn")
  cfg = select.default_kernel(jnp.float8_e4m3fn)
  e4, bf16 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.bfloat16)
  specs = (jax.ShapeDtypeStruct(case.a_shape, e4), jax.ShapeDtypeStruct(case.b_shape, e4),
           jax.ShapeDtypeStruct((2 * (lb.WORLD + 1),), np.uint32),
           jax.ShapeDtypeStruct((1,), np.int32))
  for engine in ("tl", "gluon"):
    program = lb.fused_program(case, dataclasses.replace(cfg, engine=engine), 132,
                               compute_capability=90, poison=True)
    out = jax.eval_shape(program, *specs)
    assert out.shape == case.out_shape and out.dtype == bf16
    jax.export.export(program, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call_ffi")])(*specs)
  gemm = (jax.ShapeDtypeStruct(case.local_gemm[:2], e4),
          jax.ShapeDtypeStruct((case.local_gemm[2], case.local_gemm[1]), e4))
  assert jax.eval_shape(gemm_program(case), *gemm).dtype == bf16
  engine = engine_program(dataclasses.replace(cfg, engine="gluon"), 132, compute_capability=90,
                          out_dtype=bf16)
  jax.export.export(engine, platforms=["cuda"], disabled_checks=[
      jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call_ffi")])(*gemm)


@pytest.mark.parametrize("trace,world", [(False, 2), (True, 2), (False, 8)],
                         ids=["plain", "trace", "world8"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_loopback_programs_compile_with_and_without_timeline(monkeypatch, tmp_path, op, trace,
                                                             world):
  """bench/loopback/'s fused program (set-up kernel + fused Gluon kernel), as the benchmark and
  its --trace build it: trace returns (output, int64 timeline), the plain one the output only;
  in a group of 8 the table has 9 address pairs."""
  from jax_autooverlap.bench import loopback as lb
  case = lb.Case(op, 1024, 1024, 1024, dtype="bfloat16", world=world)
  cfg = KernelConfig(engine="gluon")
  program = lb.fused_program(case, cfg, 132, compute_capability=90, trace=trace)
  specs = (jax.ShapeDtypeStruct(case.a_shape, jnp.bfloat16),
           jax.ShapeDtypeStruct(case.b_shape, jnp.bfloat16),
           jax.ShapeDtypeStruct((2 * (world + 1),), np.uint32), jax.ShapeDtypeStruct((1,), np.int32))
  out = jax.eval_shape(program, *specs)
  if trace:
    assert out[0].shape == case.out_shape and out[1].dtype == np.int64 and out[1].shape[1:] == (257, 6)
  else:
    assert out.shape == case.out_shape
  jax.export.export(program, platforms=["cuda"], disabled_checks=[
      jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call_ffi")])(*specs)


def _ptxas_report(ptx: str, tmp_path) -> str:
  """ptxas -v on `ptx` with the ptxas XLA assembles it with on the GPU (the machine's CUDA;
  triton's own where there is none): its register report."""
  import subprocess
  from triton.backends.nvidia.compiler import get_ptxas
  from jax_autooverlap import _compat
  src = tmp_path / "kernel.ptx"
  src.write_text(ptx)
  runtime = _compat.runtime_ptxas()
  run = subprocess.run([runtime[0] if runtime else get_ptxas(90).path, "-arch=sm_90a", "-v", str(src), "-o", os.devnull],
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  return run.stdout + run.stderr


def _assert_no_spills(ptx: str, tmp_path):
  """ptxas neither spills nor serializes the wgmma for lack of registers (warning C7512)."""
  report = _ptxas_report(ptx, tmp_path)
  assert "C7512" not in report and "serialized" not in report, report
  assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", report), report


def _tl_default(dtype) -> KernelConfig:
  """The default tl config of a dtype (select.default_kernel's, whatever the environment's
  engine)."""
  return dataclasses.replace(select.default_kernel(dtype), engine="tl")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("kind", ["gemm", "ag", "rs", "rs_wg", "gemm_64"])
def test_gluon_kernels_neither_spill_nor_serialize_their_wgmma(monkeypatch, tmp_path, kind,
                                                               dtype):
  """Every Gluon kernel, default config (gemm_64: the engine alone with 64-row tiles), a large
  shape, 16-bit and fp8 operands: ptxas reports no spills and does not serialize the wgmma for
  lack of registers (warning C7512), which a kernel can compile with and run correctly but
  slowly (seen on a GEMM+RS variant, docs/NOTES.md)."""
  ptx = _exported_ptx(monkeypatch, tmp_path / "dump",
                      *_gluon_program(kind, 8192, 4096, 4096, dtype=jnp.dtype(dtype)))
  _assert_no_spills(ptx, tmp_path)


def test_gluon_ag_mover_boxes_are_8_kb_in_every_dtype():
  """The Gluon AG mover keeps two staging boxes in flight, so its push rate is set by the box's
  bytes: 64 rows of 128 bytes in 16-bit and fp8 dtypes alike (fp8's 4 KB boxes pushed at half
  the rate while its GEMM runs twice as fast; docs/NOTES.md, fourteenth round)."""
  from triton.experimental.gluon import language as gl
  from jax_autooverlap.kernels import gluon_ag_gemm
  for dtype in (gl.bfloat16, gl.float16, gl.float8e4nv, gl.float8e5):
    assert gluon_ag_gemm.BOX * gluon_ag_gemm.box_cols(dtype) * dtype.primitive_bitwidth // 8 == (
        8192)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("kind", ["rs", "rs_wg"])
def test_gluon_gemm_rs_does_not_spill_in_a_group_of_8(monkeypatch, tmp_path, kind, dtype):
  """GEMM+RS at world 8: its own tiles' sum is unrolled over the 7 peers, in column blocks
  (gluon_gemm_rs.SUM_PARTS) with the accumulator split likewise; no spills, in both
  partitionings (LLVM under triton 3.6 once sank a block's adds past later rounds, keeping
  their loaded values live: gluon_engine.add_partial)."""
  ptx = _exported_ptx(monkeypatch, tmp_path / "dump",
                      *_gluon_program(kind, 8192, 1792, 4096, dtype=jnp.dtype(dtype), world=8))
  assert ptx.count("cp.async.bulk.tensor") > 0
  _assert_no_spills(ptx, tmp_path)


@pytest.mark.parametrize("kind", ["rs", "rs_wg"])
def test_gluon_gemm_rs_in_a_group_of_1_reads_no_partial(monkeypatch, tmp_path, kind):
  """A group of 1 (an axis of size 1 with impl="triton") has no peers: neither the producer's
  look nor the own tiles' wait reads an arrival counter (their acquire loads are the only
  ones in the kernel; de0a68e's build had three at world 1: it waited for a first peer that
  does not exist), and no partial is loaded (its only shared-memory reads are ldmatrix)."""
  ptx = _exported_ptx(monkeypatch, tmp_path / "dump",
                      *_gluon_program(kind, 2048, 1024, 768, world=1))
  assert "ld.global.acquire" not in ptx and "ldmatrix" not in ptx
  _assert_no_spills(ptx, tmp_path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_tl_kernels_do_not_spill(monkeypatch, tmp_path, op, dtype):
  """The tl kernels with the default config (128x256 tiles, 8 warps), 16-bit and fp8 operands:
  ptxas reports no spills.  GEMM+RS summed its own rows into a second f32 tile beside the
  accumulator and spilled 264 (bf16) / 328 (fp8) bytes per thread at 255 registers."""
  dt = jnp.dtype(dtype)
  ptx = _ptx(monkeypatch, tmp_path / "dump", dt, _tl_default(dt), 8192 if op == "rs" else 4096,
             4096, 4096, 2, return_gathered=False, op=op)
  _assert_no_spills(ptx, tmp_path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("engine", ["tl", "gluon"])
def test_gemm_rs_compiles_a_ragged_k(monkeypatch, tmp_path, engine, dtype):
  """GEMM+RS with a K that is not a multiple of the k-block (Qwen2-72B's down projection at
  TP = 8: 3696 per GPU): both engines build it (the last k-block's TMA loads are zero-filled
  past K), without spills or a serialized wgmma."""
  dt = jnp.dtype(dtype)
  if engine == "tl":
    ptx = _ptx(monkeypatch, tmp_path / "dump", dt, _tl_default(dt), 8192, 3696, 8192, 2,
               return_gathered=False, op="rs")
  else:
    ptx = _exported_ptx(monkeypatch, tmp_path / "dump", *_gluon_program("rs", 8192, 3696, 8192, dt))
  assert "cp.async.bulk.tensor" in ptx and "ld.global.acquire.sys" in ptx
  _assert_no_spills(ptx, tmp_path)


def test_gemm_rs_with_warpgroup_partitions_compiles(monkeypatch, tmp_path):
  """GEMM+RS with a consumer partition per warpgroup (WG_PARTS = 2: autotuning times it) builds
  for sm_90a with the plain kernel's fast paths: 64-row wgmma, TMA pushes and stores, the full
  store-completion wait before a release, bounded acquire waits, warp specialisation."""
  ptx = _exported_ptx(monkeypatch, tmp_path, *_gluon_program("rs_wg", 1200, 512, 1280))
  assert "wgmma.mma_async.sync.aligned.m64n256k16" in ptx
  assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx, "pushes/stores are not TMA stores"
  assert "cp.async.bulk.wait_group 0;" in ptx, "no full TMA-store completion wait before release"
  assert "ld.global.acquire.sys" in ptx and "sys.release" in ptx and "%globaltimer" in ptx
  assert "setmaxnreg" in ptx and ".reqntid 384" in ptx
  assert_scratch_is_the_operand(ptx)


@pytest.mark.parametrize("entry", list_configs(),
                         ids=lambda e: f"{e[0]}-{e[1]}-{e[2].engine}-{e[2].block_m}x{e[2].block_n}"
                                       f"-k{e[2].split_k}-t{e[2].split_tail}"
                                       f"{'-p' if e[2].pack_shards else ''}"
                                       f"-w{e[3]}-{'x'.join(map(str, e[4]))}")
def test_small_shape_configs_of_the_shape_list_compile_without_spills(monkeypatch, tmp_path,
                                                                      entry):
  """Every config an entry of the benchmark's shape list selects beyond the tuner's own, in bf16
  and fp8 (tests/ptx_dump.py list_configs: narrower tiles on both engines, split-K and packed
  shards on tl), at that entry's per-rank shape: the tile's wgmma, TMA, the cross-GPU protocol, split-K's GPU-scope
  counting and L1-bypassing reads, and ptxas neither spills nor serializes the wgmma."""
  op, dtype, cfg, world, (m, k, n) = entry
  ptx = _ptx(monkeypatch, tmp_path / "dump", jnp.dtype(dtype), cfg, m, k, n, world,
             return_gathered=False, op=op)
  # warps stacked along M (16 rows each), the rest of them split N: 64x256 on 8 warps is two
  # warpgroups of m64n128; fp8 multiplies k32 at a time (e4m3 x e4m3)
  warps_n = cfg.num_warps // min(cfg.num_warps, cfg.block_m // 16)
  kind = "k32.f32.e4m3.e4m3" if fp8.is_fp8(dtype) else "k16"
  assert f"wgmma.mma_async.sync.aligned.m64n{cfg.block_n // warps_n}{kind}" in ptx, \
      "not the tile's wgmma"
  _check_dtype(ptx, jnp.dtype(dtype))
  assert "cp.async.bulk.tensor" in ptx, "GEMM lost its TMA loads"
  assert "ld.global.acquire.sys" in ptx and "sys.release" in ptx and "%globaltimer" in ptx
  assert_scratch_is_the_operand(ptx)
  _check_engine(ptx, cfg)
  if op == "ag":  # a spread split tile's parts store their rows without TMA (split_k.py Spread)
    _, _, _, num_ctas, tiles = ag_grid(m, n, world, cfg, 132)
    tma_store = "cp.async.bulk.tensor.2d.global.shared" in ptx or \
        "cp.async.bulk.tensor.3d.global.shared" in ptx
    assert tma_store == (spread_rows(cfg, tiles, num_ctas) == 0), "not the launch's combine"
  if op == "rs" and cfg.pack_shards and cfg.split_k > 1:
    # spread, a part waits for its tile's other parts before summing its rows: a second wait
    _, _, _, num_ctas, tiles = rs_grid(m, n, world, cfg, 132)
    waits = ptx.count("ld.global.acquire.sys") // 2  # each: a first load, then the polling one
    assert waits == (2 if spread_rows(cfg, tiles, num_ctas) else 1), "not the launch's combine"
  if cfg.split_k > 1:  # the parts' counter (and finish_call's), the partials read past L1
    assert ptx.count("atom.global.gpu.acq_rel.add") >= 2 and "ld.global.cg" in ptx
  elif cfg.pack_shards and op == "rs":  # the peers' partials of the own rows, read past L1
    assert "ld.global.cg" in ptx
  else:
    assert "ld.global.cg" not in ptx
  _assert_no_spills(ptx, tmp_path)


@pytest.mark.parametrize("entry", wide_output_configs(),
                         ids=lambda e: f"{e[0]}-{e[1]}-{e[2].engine}-{e[2].block_m}x{e[2].block_n}"
                                       f"-k{e[2].split_k}{'-p' if e[2].pack_shards else ''}"
                                       f"-w{e[3]}-{'x'.join(map(str, e[4]))}")
def test_float32_products_compile_without_spills(monkeypatch, tmp_path, entry):
  """A float32 product of bf16 or fp8 operands (preferred_element_type=float32): every kind of
  config a first call times for one (tests/ptx_dump.py wide_output_configs; the usual ones in
  128x256 tiles, 128x128 in the Gluon GEMM+RS: select.default_kernel, wide_output_tiles) keeps the
  fast paths and the cross-GPU protocol, and ptxas neither spills nor serializes the wgmma."""
  op, dtype, cfg, world, (m, k, n) = entry
  ptx = _ptx(monkeypatch, tmp_path / "dump", jnp.dtype(dtype), cfg, m, k, n, world,
             return_gathered=False, op=op, out_dtype=np.float32)
  (_check_ag if op == "ag" else _check_rs)(ptx, cfg, dtype)
  _assert_no_spills(ptx, tmp_path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_the_gluon_ag_stores_a_float32_tile_of_256_columns_in_halves(monkeypatch, tmp_path,
                                                                     dtype):
  """The Gluon AG's 128x256 tiles of a float32 product (gluon_engine.out_block_n): the tile
  goes out in two column halves through one 64 KB buffer, so the kernel allocates what its
  bf16-output build does (select.shared_memory's count, at most SMEM_SLACK over Triton's) and
  has one TMA store more than that build (the mover's stores are the same in both); whole, the
  buffer needed 295,936 bytes, more than a CTA has.  The Gluon GEMM+RS keeps 128x128 for such
  products (select.wide_output_tiles)."""
  cfg = dataclasses.replace(select.default_kernel(jnp.dtype(dtype)), engine="gluon")
  assert select.wide_output_tiles(cfg, np.float32, "ag") == cfg
  assert select.wide_output_tiles(cfg, np.float32, "rs").block_n == 128
  store = r"cp\.async\.bulk\.tensor\.3d\.global\.shared"
  counts = {}
  for out_dtype, out_bytes in ((np.float32, 4), (None, 2)):
    dump = tmp_path / f"dump{out_bytes}"
    ptx = _ptx(monkeypatch, dump, jnp.dtype(dtype), cfg, 2048, 4096, 4096, 2,
               return_gathered=False, op="ag", out_dtype=out_dtype)
    counts[out_bytes] = len(re.findall(store, ptx))
    info = glob.glob(str(dump / "**" / "*.compile_info"), recursive=True)
    triton_bytes = int(re.search(r"shared_mem_bytes: (\d+)",
                                 pathlib.Path(info[0]).read_text())[1])
    model = select.shared_memory(cfg, "ag", jnp.dtype(dtype).itemsize, out_bytes)
    assert 0 <= model - triton_bytes <= select.SMEM_SLACK, (out_bytes, model, triton_bytes)
    assert model <= select.SMEM_LIMIT
    _assert_no_spills(ptx, tmp_path)
  assert counts[4] == counts[2] + 1, counts


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_the_gluon_gemm_alone_stores_a_float32_tile_of_256_columns_in_halves(
    monkeypatch, tmp_path, dtype):
  """The Gluon engine's GEMM alone (the benchmarks' engine_alone, backends/gluon.launch_gemm)
  at 128x256 compiles for a 16-bit and a float32 output, the float32 tile in two column halves
  (one 2-D TMA store more) and without spills.  (The float32 build once failed under Triton
  3.6 alone: its output descriptor took the buffer's width as a plain int.)"""
  from jax_autooverlap._compat import import_jax_triton
  from jax_autooverlap.backends import gluon
  import_jax_triton()
  from jax_triton import triton_lib
  dt = jnp.dtype(dtype)
  cfg = dataclasses.replace(select.default_kernel(dt), engine="gluon")
  assert (cfg.block_m, cfg.block_n) == (128, 256)
  m, k, n = 1024, 2048, 1024
  b = (n, k) if fp8.is_fp8(dt) else (k, n)
  counts = {}
  for out_dtype in (jnp.bfloat16, jnp.float32):
    dump = tmp_path / jnp.dtype(out_dtype).name
    monkeypatch.setattr(triton_lib, "_JAX_TRITON_DUMP_DIR", str(dump))
    f = lambda a, b, out=out_dtype: gluon.launch_gemm(a, b, kernel=cfg, out_dtype=out,
                                                      num_sms=132, compute_capability=90)
    jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call_ffi")])(
            jax.ShapeDtypeStruct((m, k), dt), jax.ShapeDtypeStruct(b, dt))
    (ptx,) = [pathlib.Path(p).read_text()
              for p in glob.glob(str(dump / "**" / "*.ptx"), recursive=True)]
    assert "wgmma.mma_async" in ptx
    counts[jnp.dtype(out_dtype).name] = len(re.findall(
        r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ptx))
    _assert_no_spills(ptx, tmp_path)
  assert counts["float32"] == counts["bfloat16"] + 1, counts


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_a_float32_tile_of_256_columns_is_stored_in_halves(monkeypatch, tmp_path, op, dtype):
  """tl's 128x256 tiles of a float32 product: the AG stores the tile in two column halves
  through one 64 KB buffer (select.shared_memory's count: at most SMEM_SLACK over Triton's, in
  a CTA; Triton 3.6 stores without it), the second written only once the first store has read
  it; GEMM+RS sums and stores
  its own tiles in halves (two 2-D TMA stores).  Whole, the AG's buffer needed 278,552 bytes
  and GEMM+RS spilled 84 (bf16) / 76 (fp8) bytes; now neither spills."""
  import triton
  cfg = select.default_kernel(jnp.dtype(dtype), np.float32)
  assert (cfg.block_m, cfg.block_n) == (128, 256)
  ptx = _ptx(monkeypatch, tmp_path / "dump", jnp.dtype(dtype), cfg, 2048, 4096, 4096, 2,
             return_gathered=False, op=op, out_dtype=np.float32)
  dims = "3d" if op == "ag" else "2d"
  store = rf"cp\.async\.bulk\.tensor\.{dims}\.global\.shared"
  stores = [m.start() for m in re.finditer(store, ptx)]
  assert len(stores) == 2, len(stores)
  if op == "ag":
    assert "cp.async.bulk.wait_group.read" in ptx[stores[0]:stores[1]]
    info = glob.glob(str(tmp_path / "dump" / "**" / "*.compile_info"), recursive=True)
    triton_bytes = int(re.search(r"shared_mem_bytes: (\d+)",
                                 pathlib.Path(info[0]).read_text())[1])
    model = select.shared_memory(cfg, op, jnp.dtype(dtype).itemsize, 4)
    allowance = select.SMEM_SLACK + (128 * 128 * 4 if triton.__version__.startswith("3.6") else 0)
    assert 0 <= model - triton_bytes <= allowance and model <= select.SMEM_LIMIT
  _assert_no_spills(ptx, tmp_path)


@pytest.mark.parametrize("cfg", [KernelConfig(engine="gluon", block_m=64, block_n=128, num_warps=4),
                                 KernelConfig(block_m=64, block_n=128, num_warps=4, split_k=3)],
                         ids=["gluon-64x128", "tl-64x128-k3"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_small_tiles_compile_for_a_group_of_8(monkeypatch, tmp_path, op, cfg):
  """The new kernel paths with WORLD = 8 (seven peers' descriptors and counters): a 16-row
  shard (ag) or 16 output rows per owner (rs), as M = 128 gives at TP = 8."""
  m = 16 if op == "ag" else 128
  ptx = _ptx(monkeypatch, tmp_path, jnp.dtype(jnp.bfloat16), cfg, m, 4096, 768 if op == "ag" else 512,
             world=8, return_gathered=(op == "ag"), op=op)
  assert "wgmma.mma_async.sync.aligned.m64n128k16" in ptx
  assert "ld.global.acquire.sys" in ptx and "sys.release" in ptx
  _check_engine(ptx, cfg)


@pytest.mark.parametrize("pair", [("float8_e5m2", "float8_e4m3fn"),
                                  ("float8_e4m3fn", "float8_e5m2")], ids=["e5m2xe4m3", "e4m3xe5m2"])
@pytest.mark.parametrize("engine", ["tl", "gluon"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fp8_kernels_multiply_mixed_formats(monkeypatch, tmp_path, op, engine, pair):
  """e5m2 x e4m3 (a backward pass: the gradient times a weight) and e4m3 x e5m2 operands: one
  wgmma of that pairing (k32), TMA loads, the release/acquire protocol; b K-major ([N, K])."""
  cfg = dataclasses.replace(select.default_kernel(jnp.float8_e4m3fn), engine=engine)
  ptx = _ptx(monkeypatch, tmp_path, jnp.dtype(pair[0]), cfg, 1024, 2048, 1536, world=2,
             return_gathered=(op == "ag"), op=op, b_dtype=pair[1])
  a, b = map(fp8.short, pair)
  assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.{a}\.{b}", ptx), \
      "no wgmma of this fp8 pairing"
  assert "cp.async.bulk.tensor" in ptx
  assert "ld.global.acquire.sys" in ptx and "sys.release" in ptx
  assert_scratch_is_the_operand(ptx)


@pytest.mark.parametrize("engine", ["tl", "gluon"])
@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fp8_kernels_compile_for_larger_groups(monkeypatch, tmp_path, world, op, engine):
  cfg = dataclasses.replace(select.default_kernel(jnp.float8_e4m3fn), engine=engine)
  ptx = _ptx(monkeypatch, tmp_path, jnp.dtype(jnp.float8_e4m3fn), cfg,
             1024 if op == "ag" else 4096, 2048, 3072, world=world, return_gathered=(op == "ag"),
             op=op)
  _check_dtype(ptx, jnp.float8_e4m3fn)
  assert "ld.global.acquire.sys" in ptx and "sys.release" in ptx


@pytest.mark.parametrize("mode", ["full", "tma", "read", "ldg", "nofence", "halves", "quarters",
                                  "background"])
def test_own_round_experiment_compiles(monkeypatch, tmp_path, mode):
  """bench/own_round.py (the GEMM+RS own-tile round in isolation, run on the GPU machine):
  its kernel builds in each mode (background: halves beside background loaders), TMA-loads
  where it should, and does not spill."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "own_round", pathlib.Path(__file__).resolve().parents[1] / "bench" / "own_round.py")
  own_round = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(own_round)
  f, parts = (own_round.program(132, 7, "halves", False, 132 * 7 * 128, summers=16,
                                bg_pace_ns=950) if mode == "background" else
               own_round.program(132, 7, mode, False, 132 * 7 * 128))
  ptx = _exported_ptx(monkeypatch, tmp_path / "dump", f, [parts])
  # mode read loads its one tile too, before the clock; mode ldg loads none
  assert ("cp.async.bulk.tensor" in ptx) == (mode != "ldg")
  assert ("ld.global.cg" in ptx) == (mode == "ldg")
  _assert_no_spills(ptx, tmp_path)


@pytest.mark.parametrize("op,shape", [("ag", (128, 4096, 6144)), ("rs", (128, 4096, 4096))],
                         ids=["ag-128x4096x6144", "rs-128x4096x4096"])
def test_tl_variants_alone_compile_in_a_group_of_one(op, shape):
  """The loopback benchmark's engine_alone_tl programs (cli.alone_case, alone_config: every tl
  variant of a TP 8 M = 128 entry in a group of one) build for sm_90: set-up kernel, then the
  tl kernel with one address pair and its split-K partials."""
  from jax_autooverlap.bench import loopback as lb
  case = lb.Case(op, *shape, world=8)
  one = lb.alone_case(case)
  configs = {lb.alone_config(case, c)
             for c in lb.fused_variants(case, "NVIDIA H200", ["tl"], 132).values()} - {None}
  assert any(c.split_k > 1 for c in configs)  # the packed variants' splits, unpacked
  specs = (jax.ShapeDtypeStruct(one.a_shape, jnp.bfloat16),
           jax.ShapeDtypeStruct(one.b_shape, jnp.bfloat16),
           jax.ShapeDtypeStruct((4,), np.uint32), jax.ShapeDtypeStruct((1,), np.int32))
  for cfg in configs:
    program = lb.fused_program(one, cfg, 132, compute_capability=90)
    assert jax.eval_shape(program, *specs).shape == one.out_shape  # all of the local GEMM's rows
    jax.export.export(program, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call_ffi")])(*specs)


_K = KernelConfig
_DEEP = [  # (op, dtype, config, world, local shape): every kernel's shared-memory layout, deep
    ("ag", "bfloat16", _K(block_m=128, block_n=128, num_stages=6), 2, (64, 4096, 3072)),
    ("ag", "bfloat16", _K(block_m=64, block_n=256, num_stages=5, split_k=2), 2, (128, 4096, 3072)),
    ("rs", "bfloat16", _K(block_m=128, block_n=128, num_stages=6, split_k=4, pack_shards=True), 2,
     (128, 2048, 4096)),
    ("rs", "bfloat16", _K(block_m=64, block_n=128, num_warps=4, num_stages=8), 2, (256, 4096, 4096)),
    ("ag", "bfloat16", _K(engine="gluon", block_m=64, block_n=128, num_warps=4, num_stages=8), 2,
     (128, 4096, 4096)),
    ("rs", "bfloat16", _K(engine="gluon", block_m=128, block_n=128, num_stages=6), 2,
     (256, 4096, 4096)),
    ("ag", "float8_e4m3fn", _K(engine="gluon", block_m=128, block_n=128, block_k=128, num_stages=5),
     2, (128, 4096, 4096)),
    ("rs", "float8_e4m3fn", _K(block_m=128, block_n=128, block_k=128, num_stages=6), 2,
     (256, 4096, 4096))]


@pytest.mark.parametrize("case", _DEEP, ids=lambda c: f"{c[0]}-{c[1]}-{c[2].engine}-"
                         f"{c[2].block_m}x{c[2].block_n}-k{c[2].split_k}-s{c[2].num_stages}")
def test_the_shared_memory_model_is_what_triton_allocates(monkeypatch, tmp_path, case):
  """select.shared_memory, which decides which configs (and `bench --stages` depths) run, counts
  each kernel's shared memory: at most SMEM_SLACK over Triton's own count (compile_info), never
  under it (a config it passed would fail to launch), and for deep pipelines (the one place it
  is tight) without spills.  Triton 3.6 stores the tl AG+GEMM's unsplit output tile without
  shared memory; the model keeps 3.9's."""
  import triton
  op, dtype, cfg, world, (m, k, n) = case
  dt = jnp.dtype(dtype)
  out_bytes = 2
  ptx = _ptx(monkeypatch, tmp_path / "dump", dt, cfg, m, k, n, world, return_gathered=False,
             op=op)
  info = glob.glob(str(tmp_path / "dump" / "**" / "*.compile_info"), recursive=True)
  triton_bytes = int(re.search(r"shared_mem_bytes: (\d+)", pathlib.Path(info[0]).read_text())[1])
  model = select.shared_memory(cfg, op, dt.itemsize, out_bytes)
  allowance = select.SMEM_SLACK
  if (cfg.engine, op, cfg.split_k) == ("tl", "ag", 1) and triton.__version__.startswith("3.6"):
    allowance += cfg.block_m * cfg.block_n * out_bytes
  assert 0 <= model - triton_bytes <= allowance, (model, triton_bytes)
  assert model <= select.SMEM_LIMIT
  _assert_no_spills(ptx, tmp_path)
