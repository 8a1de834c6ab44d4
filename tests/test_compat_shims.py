"""The jax-triton shims of _compat.py: one test (at least) per fix, on the Triton pip gives.

Unit tests run anywhere; the compile tests need the jax-cuda plugin (compile
for sm_90a without a GPU, as tests/test_kernel_compile.py).
"""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_autooverlap import _compat


class _Module:
  def __init__(self, gluon):
    self.gluon = gluon

  def get_int_attr(self, name):
    assert name == "ttg.num-warps"
    return 8 if self.gluon else None


class _Backend:
  """Records which front-end stages ran; reports descriptor metadata like triton 3.6."""

  def __init__(self):
    self.calls = []

  def make_ttir(self, mod, metadata, options, capability):
    self.calls.append("make_ttir")
    return mod

  def make_ttgir(self, mod, metadata, options, capability):
    self.calls.append("make_ttgir")
    metadata["tensordesc_meta"] = [{"swizzle": 3, "elem_size": 2}]
    return mod

  def gluon_to_ttgir(self, mod, metadata, options, capability):
    self.calls.append("gluon_to_ttgir")
    metadata["tensordesc_meta"] = [{"swizzle": 3, "is_im2col": True}]
    return mod

  def make_llir(self, *args):
    return "llir"


@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_front_end_stage_follows_the_language(gluon):
  backend = _Backend()
  stages = _compat._GluonAwareStages(backend)
  mod, md = _Module(gluon), {}
  assert stages.make_ttgir(stages.make_ttir(mod, md, None, 90), md, None, 90) is mod
  assert backend.calls == (["gluon_to_ttgir"] if gluon else ["make_ttir", "make_ttgir"])
  assert stages.make_llir() == "llir"  # every other stage is the backend's own


def test_descriptor_metadata_gets_is_im2col_only_where_missing():
  stages = _compat._GluonAwareStages(_Backend())
  md = {}
  stages.make_ttgir(_Module(False), md, None, 90)
  assert md["tensordesc_meta"] == [{"swizzle": 3, "elem_size": 2, "is_im2col": False}]
  md = {}
  stages.make_ttgir(_Module(True), md, None, 90)
  assert md["tensordesc_meta"] == [{"swizzle": 3, "is_im2col": True}]  # triton's value kept


def test_launch_warps_come_from_the_ptx_block_size():
  ptx = ".visible .entry k(\n.param .u64 k_param_0\n)\n.reqntid 384\n{\n ret;\n}"
  assert _compat.launch_warps(ptx, 8) == 12
  assert _compat.launch_warps(ptx.replace("384", "256"), 8) == 8
  assert _compat.launch_warps(".visible .entry k()\n{\n}", 4) == 4   # no .reqntid: as asked
  assert _compat.launch_warps("/tmp/kernel.hsaco", 4) == 4           # ROCm passes a path
  calls = []
  lib = types.SimpleNamespace(TritonKernel=lambda *a: calls.append(a) or "kernel", other=1)
  shim = _compat._KernelLib(lib)
  assert shim.TritonKernel("k", 8, 1, 1024, ptx, "ttir", 90, 384, 128) == "kernel"
  assert calls == [("k", 12, 1, 1024, ptx, "ttir", 90, 384, 128)]
  assert shim.other == 1


# --- through jax-triton, compile only --------------------------------------------------------

def _needs_compile_path():
  pytest.importorskip("jaxlib.gpu_triton")
  gpu_triton = pytest.importorskip("jax._src.lib").gpu_triton
  if gpu_triton is None or not hasattr(gpu_triton, "TritonKernel"):
    pytest.skip("jax-cuda plugin not installed: no Triton compile path")
  return _compat.import_jax_triton()


def _export(f, *specs):
  jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
      jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call_ffi")])(*specs)


@pytest.fixture
def kernel_args(monkeypatch):
  """The arguments jax-triton builds each compiled kernel with (after the shims)."""
  _needs_compile_path()
  from jax_triton import triton_lib
  shim = triton_lib.triton_kernel_call_lib
  assert isinstance(shim, _compat._KernelLib), "launch-width shim not installed"
  seen = []

  class Recorder:
    def __getattr__(self, name):
      return getattr(real, name)

    def TritonKernel(self, *args):  # noqa: N802
      seen.append(args)
      return real.TritonKernel(*args)
  real = shim._lib
  monkeypatch.setattr(shim, "_lib", Recorder())
  return seen


def test_host_descriptor_kernel_compiles(kernel_args):
  """Fix 4: triton 3.6 writes no is_im2col key; jax-triton refused the metadata."""
  import triton
  import triton.language as tl
  jt = _compat.import_jax_triton()

  @triton.jit
  def copy_block(a_desc, o_ptr):
    offs = tl.arange(0, 64)[:, None] * 64 + tl.arange(0, 64)[None, :]
    tl.store(o_ptr + offs, a_desc.load([0, 0]))

  f = lambda a: jt.triton_call(jt.TensorDescriptor.from_array(a, (64, 64)), kernel=copy_block,
                               out_type=jax.ShapeDtypeStruct((64, 64), jnp.bfloat16), grid=(1,),
                               num_warps=4, compute_capability=90)
  _export(f, jax.ShapeDtypeStruct((128, 64), jnp.bfloat16))
  assert [a[1] for a in kernel_args] == [4]  # not warp-specialised: launched as asked


def test_gluon_kernel_takes_gluon_front_end_and_launches_all_its_warps(kernel_args, monkeypatch,
                                                                       tmp_path):
  """Fixes 5 and 6 on the engine's plain GEMM (8 consumer warps + 1 producer warp -> 12)."""
  jt = _compat.import_jax_triton()
  from jax_triton import triton_lib
  from triton.backends.nvidia.compiler import CUDABackend

  from jax_autooverlap.kernels.gluon_gemm import gluon_gemm_kernel
  stages = []
  real = CUDABackend.gluon_to_ttgir
  monkeypatch.setattr(CUDABackend, "gluon_to_ttgir",
                      lambda self, *a: stages.append("gluon_to_ttgir") or real(self, *a))
  monkeypatch.setattr(triton_lib, "_JAX_TRITON_DUMP_DIR", str(tmp_path))
  monkeypatch.setattr(gluon_gemm_kernel, "_jT_kernel_cache", {}, raising=False)
  m, k, n = 512, 1024, 768
  from jax_autooverlap.backends.gluon import host_descs
  from jax_autooverlap.tuning.config import KernelConfig
  f = lambda a, b: jt.triton_call(
      *host_descs(a, b, KernelConfig(engine="gluon")), kernel=gluon_gemm_kernel,
      out_type=(jax.ShapeDtypeStruct((m, n), jnp.bfloat16), jax.ShapeDtypeStruct((4,), np.int64),
                _compat.scratch_out_type(8)),
      grid=(8,), num_warps=8, compute_capability=90, M=m, K=k, N=n, BLOCK_M=128, BLOCK_N=256,
      BLOCK_K=64, GROUP_M=8, STAGES=3, NUM_CTAS=8, TRACE=False)
  _export(f, jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), np.dtype(jnp.bfloat16)))
  assert stages == ["gluon_to_ttgir"]
  assert [a[1] for a in kernel_args] == [12]
  (ptx,) = [p.read_text() for p in tmp_path.glob("**/*.ptx")]
  # one MMA group in flight in the main loop; the only full wait is after it
  assert ptx.count("wgmma.wait_group.sync.aligned 1;") == 1
  assert ptx.count("wgmma.wait_group.sync.aligned 0;") == 1


# --- global scratch as an operand, no TTIR in the opaque (fixes 2 and 3) ----------------------

_PTX = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u64 .ptr .global .align 1 k_param_1,
	.param .u64 .ptr .global .align 1 k_param_2,
	.param .u64 .ptr .global .align 1 k_param_3
)
{
	ld.param.b64 	%rd1, [k_param_0];
	ld.param.b64 	%rd2, [k_param_2];
	ld.param.b64 	%rd12, [k_param_12];
}
"""


def test_redirect_reads_the_scratch_operand_instead_of_the_implicit_pointer():
  out = _compat.redirect_scratch_param(_PTX, "k")
  # params: 0 input, 1 scratch operand, 2 implicit global scratch, 3 implicit profile scratch
  assert "[k_param_2]" not in out and out.count("[k_param_1]") == 1
  assert "[k_param_0]" in out and "[k_param_12]" in out  # other parameters untouched


def test_redirect_refuses_unexpected_ptx():
  with pytest.raises(RuntimeError, match="no .entry"):
    _compat.redirect_scratch_param(_PTX, "other")
  with pytest.raises(RuntimeError, match="2 parameters"):
    _compat.redirect_scratch_param(".entry k(\n .param .u64 k_param_0,\n .param .u64 k_param_1\n)", "k")


def test_only_registered_kernels_are_rewritten_and_oversized_scratch_is_refused():
  import dataclasses

  @dataclasses.dataclass(frozen=True)
  class Compiled:
    binary: str
    name: str
    global_scratch_size: int | None
    global_scratch_align: int | None

  other = Compiled(_PTX, "not_ours", 512, 128)
  assert _compat._scratch_as_operand(other) is other
  _compat._lean_kernels.add("k")
  try:
    out = _compat._scratch_as_operand(Compiled(_PTX, "k", 512, 128))
    assert out.global_scratch_size is None and out.global_scratch_align is None
    assert "[k_param_2]" not in out.binary
    with pytest.raises(RuntimeError, match="needs 8192 bytes"):
      _compat._scratch_as_operand(Compiled(_PTX, "k", 8192, 128))
  finally:
    _compat._lean_kernels.discard("k")


def test_lean_kernels_are_built_without_ttir():
  made = []

  class Lib:
    version = 7

    @staticmethod
    def TritonKernel(*args):
      made.append(args)

  lib = _compat._KernelLib(Lib())
  assert lib.version == 7  # everything else passes through
  _compat._lean_kernels.add("k")
  try:
    lib.TritonKernel("k", 8, 1, 1000, "ptx", "ttir text", 90, 512, 128)
    lib.TritonKernel("other", 8, 1, 1000, "ptx", "ttir text", 90)
  finally:
    _compat._lean_kernels.discard("k")
  assert made == [("k", 8, 1, 1000, "ptx", "", 90, 512, 128),
                  ("other", 8, 1, 1000, "ptx", "ttir text", 90)]


# --- PTX version the runtime's ptxas accepts (fix 7) ----------------------------------------

def _fake_ptxas(tmp_path, name, release):
  path = tmp_path / name
  path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
  path.chmod(0o755)
  return str(path)


def test_runtime_ptxas_is_the_one_accepting_the_lowest_ptx(monkeypatch, tmp_path):
  pytest.importorskip("triton.backends.nvidia.compiler")
  paths = [_fake_ptxas(tmp_path, "new", "13.4"), _fake_ptxas(tmp_path, "old", "13.0"),
           str(tmp_path / "missing")]
  monkeypatch.setattr(_compat, "_ptxas_candidates", lambda: paths)
  _compat.runtime_ptxas.cache_clear()
  try:
    assert _compat.runtime_ptxas() == (paths[1], 90)
    monkeypatch.setattr(_compat, "_ptxas_candidates", lambda: [str(tmp_path / "missing")])
    _compat.runtime_ptxas.cache_clear()
    assert _compat.runtime_ptxas() is None
  finally:
    _compat.runtime_ptxas.cache_clear()


def test_ptx_version_lowered_only_where_triton_would_write_a_newer_one(monkeypatch):
  compiler = pytest.importorskip("triton.backends.nvidia.compiler")
  options = compiler.CUDAOptions()
  own = compiler.get_ptx_version_from_options(options, 90)
  monkeypatch.setattr(_compat, "runtime_ptxas", lambda: ("/cuda/bin/ptxas", own - 4))
  assert _compat.runtime_ptx_options(options, 90).ptx_version == own - 4
  monkeypatch.setattr(_compat, "runtime_ptxas", lambda: ("/cuda/bin/ptxas", own + 1))
  assert _compat.runtime_ptx_options(options, 90) is options      # triton's own choice stands
  monkeypatch.setattr(_compat, "runtime_ptxas", lambda: None)
  assert _compat.runtime_ptx_options(options, 90) is options


def test_compiled_ptx_version_is_one_the_runtime_ptxas_accepts(kernel_args):
  """On the GPU machine XLA assembled triton 3.9's PTX 9.4 with CUDA 13.0's ptxas and failed."""
  import re

  import triton
  import triton.language as tl
  runtime = _compat.runtime_ptxas()
  if runtime is None:
    pytest.skip("no ptxas besides triton's: nothing to lower to")
  jt = _compat.import_jax_triton()

  @triton.jit
  def add_one(x_ptr, o_ptr):
    offs = tl.arange(0, 128)
    tl.store(o_ptr + offs, tl.load(x_ptr + offs) + 1)

  f = lambda x: jt.triton_call(x, kernel=add_one, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                               grid=(1,), num_warps=4, compute_capability=90)
  _export(f, jax.ShapeDtypeStruct((128,), jnp.float32))
  (ptx,) = [a[4] for a in kernel_args]
  major, minor = map(int, re.search(r"^\.version (\d+)\.(\d+)", ptx, re.M).groups())
  assert major * 10 + minor <= runtime[1], (ptx[:200], runtime)
