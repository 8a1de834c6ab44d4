"""Tuner verdicts, kernel-config validation and the runtime's host-side layout (no GPU needed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_autooverlap as ao
from jax_autooverlap.runtime import workspace
from jax_autooverlap.tuning import select
from jax_autooverlap.tuning.config import KernelConfig

H200 = "NVIDIA H200"


def test_measured_cache_drives_the_choice():
  cache = select._cache()
  assert cache, "no measured tuning data shipped"
  for key, entry in cache.items():
    op, kind, world, shape, dtype = key.split("|")
    m, k, n = map(int, shape.split("x"))
    w = int(world[1:])
    if op == "ag":  # per device: a[M/w, K] gathered, b[K, N/w]
      v = select.choose_ag(ao.OverlapConfig(), kind, w, m // w, k, n // w, dtype, dtype)
    else:  # per device: a[M, K/w], b[K/w, N]
      v = select.choose_rs(ao.OverlapConfig(), kind, w, m, k // w, n, dtype, dtype)
    if entry["impl"] == "triton":
      assert v.kernel == KernelConfig(**entry["kernel"]) and "measured" in v.reason
      assert entry["ours_ms"] < entry["unfused_ms"]
    else:
      assert v.kernel is None and "measured" in v.reason


def test_small_shapes_fall_back_and_unsupported_shapes_say_why():
  v = select.choose_ag(ao.OverlapConfig(), H200, 2, 128, 1024, 512, jnp.bfloat16, jnp.bfloat16)
  assert v.kernel is None and "model: unfused" in v.reason
  v = select.choose_ag(ao.OverlapConfig(), H200, 2, 4096, 1000, 4096, jnp.bfloat16, jnp.bfloat16)
  assert v.kernel is None and "K=1000" in v.reason
  v = select.choose_ag(ao.OverlapConfig(), H200, 2, 4096, 8192, 4096, jnp.int8, jnp.int32)
  assert v.kernel is None and "int8" in v.reason
  big = KernelConfig(block_m=256, block_n=256, block_k=128, num_stages=4)
  v = select.choose_ag(ao.OverlapConfig(kernel=big), H200, 2, 4096, 8192, 4096, jnp.bfloat16,
                       jnp.bfloat16)
  assert v.kernel is None and "shared memory" in v.reason


def test_kernel_config_validation():
  with pytest.raises(ValueError, match="block_n=96"):
    KernelConfig(block_n=96)
  with pytest.raises(ValueError, match="num_warps=2"):
    KernelConfig(num_warps=2)
  with pytest.raises(ValueError, match="chunks=0"):
    KernelConfig(chunks=0)
  with pytest.raises(TypeError, match="KernelConfig"):
    ao.OverlapConfig(kernel={"block_m": 64})
  with pytest.raises(ValueError, match="timeout_s"):
    ao.OverlapConfig(timeout_s=0)


def test_impl_triton_off_gpu_is_an_error():
  from jax_autooverlap.ops.planning import plan
  with pytest.raises(ValueError, match="needs the concrete mesh"):
    plan("ag_rows", ao.OverlapConfig(impl="triton"), 2, (1, 8, 64, 8), np.float32, np.float32)


def test_workspace_layout_and_address_table():
  from types import SimpleNamespace
  from jax_autooverlap.backends.triton import _address_table
  assert workspace.buffer_offset(2) % 1024 == 0
  assert workspace.buffer_offset(8) >= workspace.FLAGS_OFFSET + workspace.flags_bytes(8)
  assert workspace.required_bytes(2, 1 << 20) == workspace.buffer_offset(2) + 4 * (1 << 20)
  devices = np.arange(8).reshape(2, 4)  # mesh ("a", "x"), gathering over "x"
  mesh = SimpleNamespace(axis_names=("a", "x"), devices=devices)
  addresses = [(i + 1) << 33 | 0x1234 for i in range(8)]
  table = _address_table(mesh, "x", 4, addresses, err_address=(99 << 32) | 7)
  assert table.shape == (2, 10) and table.dtype == np.uint32
  for g in range(2):
    for r in range(4):
      addr = int(table[g, 2 * r]) | int(table[g, 2 * r + 1]) << 32
      assert addr == addresses[devices[g, r]]
    assert int(table[g, 8]) | int(table[g, 9]) << 32 == (99 << 32) | 7


class _FakeGpu:
  platform = "gpu"
  device_kind = "NVIDIA H200"


def _fake_gpu_mesh():
  from types import SimpleNamespace
  return SimpleNamespace(devices=np.array([_FakeGpu(), _FakeGpu()]), axis_names=("x",),
                         shape={"x": 2})


_FAST = {"block_k": 64, "block_m": 128, "block_n": 256, "chunks": 8, "group_m": 8,
         "num_comm": 32, "num_stages": 3, "num_warps": 8}
_SYNTHETIC = {  # verdicts as the benchmark writes them
    f"ag|{H200}|w2|4096x8192x8192|bfloat16": {"impl": "triton", "kernel": _FAST},
    f"ag|{H200}|w2|512x8192x8192|bfloat16": {"impl": "unfused", "note": "fused kernel not faster"},
    f"rs|{H200}|w2|8192x4096x4096|bfloat16": {"impl": "unfused", "note": "fused kernel not faster"},
}


def test_gpu_plans_kernels_where_measured_and_keeps_unfused_elsewhere(monkeypatch):
  from jax_autooverlap.ops.planning import plan
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.setattr(select, "_cache", lambda: _SYNTHETIC)
  mesh, cfg, bf16 = _fake_gpu_mesh(), ao.OverlapConfig(), jnp.bfloat16
  impl, gpu, why = plan("ag_rows", cfg, 2, (1, 2048, 8192, 4096), bf16, bf16, mesh, True)
  assert impl == "triton" and gpu.kernel == KernelConfig(**_FAST) and "measured" in why
  impl, gpu, why = plan("ag_rows", cfg, 2, (1, 256, 8192, 4096), bf16, bf16, mesh, True)
  assert impl == "unfused" and "measured: unfused faster" in why              # 512x8192x8192
  impl, _, why = plan("rs_rows", cfg, 2, (1, 8192, 2048, 4096), bf16, bf16, mesh, True)
  assert impl == "unfused" and "measured" in why                               # 8192x4096x4096
  impl, gpu, why = plan("ag_rows", cfg, 2, (1, 4096, 8192, 4096), bf16, bf16, mesh, True)
  assert impl == "triton" and "model: fused" in why                            # between measured
  impl, _, why = plan("ag_k", cfg, 2, (1, 2048, 8192, 4096), bf16, bf16, mesh, True)
  assert impl == "unfused" and "contracting" in why
  impl, _, why = plan("ag_rows", cfg, 2, (4, 2048, 8192, 4096), bf16, bf16, mesh, True)
  assert impl == "unfused" and "batched" in why


def test_no_heuristic_pick_where_the_kernel_was_never_measured(monkeypatch):
  monkeypatch.setattr(select, "_cache", lambda: _SYNTHETIC)
  big = (8192, 8192, 4096, jnp.bfloat16, jnp.bfloat16)
  v = select.choose_ag(ao.OverlapConfig(), H200, 4, *big)
  assert v.kernel is None and "never measured on 4x NVIDIA H200" in v.reason
  assert "jax_autooverlap.bench ag" in v.reason
  v = select.choose_ag(ao.OverlapConfig(), "NVIDIA H100 80GB HBM3", 2, *big)
  assert v.kernel is None and "never measured" in v.reason
  assert select.choose_ag(ao.OverlapConfig(), H200, 2, *big).kernel is not None
  v = select.choose_ag(ao.OverlapConfig(impl="triton"), H200, 4, *big)  # asked for: honoured
  assert v.kernel is not None and "impl='triton'" in v.reason


def test_user_cache_dir_verdicts_override_shipped_ones(monkeypatch, tmp_path):
  from jax_autooverlap.bench.__main__ import _merge_into_user_cache, _write_tuning_cache
  monkeypatch.setenv("JAX_AUTOOVERLAP_CACHE_DIR", str(tmp_path / "cache"))
  rec = lambda impl, ms, world: {
      "op": "ag", "m": 8192, "k": 8192, "n": 8192, "dtype": "bfloat16", "world_size": world,
      "impl": impl, "median_ms": ms, "gpu": "NVIDIA-H200", "date": "2026-11-30",
      **({"kernel": _FAST} if impl == "ours" else {})}
  run = tmp_path / "run" / "tuning-ag.json"
  run.parent.mkdir()
  _write_tuning_cache(run, [rec("unfused", 2.0, 4), rec("ours", 1.5, 4)], "bfloat16", "ag")
  _merge_into_user_cache(run, "ag")
  select._cache.cache_clear()
  try:
    assert f"ag|{H200}|w4|8192x8192x8192|bfloat16" in select._cache()
    v = select.choose_ag(ao.OverlapConfig(), H200, 4, 2048, 8192, 2048, jnp.bfloat16, jnp.bfloat16)
    assert v.kernel == KernelConfig(**_FAST) and "measured" in v.reason
    # a later run where the kernel lost replaces the verdict
    _write_tuning_cache(run, [rec("unfused", 2.0, 4), rec("ours", 2.5, 4)], "bfloat16", "ag")
    _merge_into_user_cache(run, "ag")
    select._cache.cache_clear()
    v = select.choose_ag(ao.OverlapConfig(), H200, 4, 2048, 8192, 2048, jnp.bfloat16, jnp.bfloat16)
    assert v.kernel is None and "measured: unfused faster" in v.reason
  finally:
    select._cache.cache_clear()


def test_kernels_only_where_custom_calls_stay_out_of_cuda_graphs(monkeypatch):
  from jax_autooverlap.ops.planning import plan
  from jax_autooverlap.runtime import context
  mesh, cfg, bf16 = _fake_gpu_mesh(), ao.OverlapConfig(), jnp.bfloat16
  shape = (1, 2048, 8192, 4096)
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  impl, _, why = plan("ag_rows", cfg, 2, shape, bf16, bf16, mesh, False)
  assert impl == "unfused" and "CUDA graph" in why and "outermost" in why
  with pytest.raises(ValueError, match="CUDA graph"):
    plan("ag_rows", ao.OverlapConfig(impl="triton"), 2, shape, bf16, bf16, mesh, False)
  assert plan("ag_rows", cfg, 2, shape, bf16, bf16, mesh, True)[0] == "triton"
  with context.compiled_without_custom_calls_in_graphs():  # ao.jit's trace
    assert plan("ag_rows", cfg, 2, shape, bf16, bf16, mesh)[0] == "triton"
  for flags, ok in (("--xla_gpu_enable_command_buffer=FUSION,CUBLAS", True),
                    ("--xla_gpu_enable_command_buffer=", True),
                    ("--xla_gpu_enable_command_buffer=-CUSTOM_CALL", True),
                    ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL", False),
                    ("--xla_gpu_enable_command_buffer=+WHILE", False)):
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert (plan("ag_rows", cfg, 2, shape, bf16, bf16, mesh)[0] == "triton") == ok, flags


def test_compiler_options_drop_only_custom_calls_from_command_buffers(monkeypatch):
  from jax_autooverlap.runtime import context
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  opts = context.compiler_options_keeping_custom_calls_out_of_graphs()
  assert opts == {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN"}
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE")
  assert context.compiler_options_keeping_custom_calls_out_of_graphs() == {
      "xla_gpu_enable_command_buffer": "FUSION,WHILE"}


def test_ao_jit_traces_top_level_and_nested_calls_under_the_right_promise():
  from jax_autooverlap.runtime import context
  seen = []

  def f(x):
    seen.append(context.graph_safe())
    return x * 2

  g = ao.jit(f)
  assert float(g(1.0)) == 2.0 and set(seen) == {True}  # compiled with custom calls out of graphs
  seen.clear()
  assert float(jax.jit(lambda x: g(x) + 1)(1.0)) == 3.0 and set(seen) == {False}
  seen.clear()
  assert float(ao.jit(lambda x: g(x) + 1)(1.0)) == 3.0 and set(seen) == {True}
  seen.clear()
  assert float(jax.grad(ao.jit(f))(1.0)) == 2.0 and set(seen) == {False}  # eager grad: no jit
  seen.clear()

  def no_args():  # closes over the outer jit's tracer, takes no arguments
    seen.append(context.graph_safe())
    return outer_value[0] * 2

  outer_value = []
  h = ao.jit(no_args)
  assert float(jax.jit(lambda x: (outer_value.append(x), h())[1])(1.0)) == 2.0
  assert set(seen) == {False}
  seen.clear()
  mine = ao.jit(f, compiler_options={"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL"})
  assert float(mine(1.0)) == 2.0 and set(seen) == {False}  # the user's choice is kept


def test_backward_dual_inherits_graph_safety(monkeypatch):
  from jax_autooverlap.ops.planning import dual_params
  from jax_autooverlap.ops.reference import RingParams
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  ring = RingParams(axis_name="x", axis_size=2, chunks=1, precision=None,
                    out_dtype=np.dtype(jnp.bfloat16))
  a = jnp.zeros((1, 2048, 8192), jnp.bfloat16)  # the dual ag_rows of a 4096x8192x8192 rs
  b = jnp.zeros((1, 8192, 4096), jnp.bfloat16)
  mesh = _fake_gpu_mesh()
  safe = dual_params("ag_rows", a, b, ring, ao.OverlapConfig(impl="triton"), jnp.bfloat16, mesh, True)
  unsafe = dual_params("ag_rows", a, b, ring, ao.OverlapConfig(impl="triton"), jnp.bfloat16, mesh,
                       False)
  assert safe.impl == "triton" and safe.gpu.mesh is mesh and safe.graph_safe
  assert unsafe.impl == "unfused" and not unsafe.graph_safe
