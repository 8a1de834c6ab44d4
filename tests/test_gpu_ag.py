"""Fused AllGather+GEMM Triton kernel on NVIDIA GPUs (marked gpu; skipped without 2 GPUs).

Every check draws fresh random inputs and compares with the unfused JAX
program (all_gather + dot_general, NCCL + cuBLAS).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_autooverlap as ao
from conftest import (assert_close, assert_repeat_calls_identical, assert_scan_runs_the_kernel,
                      check_command_buffers_off, check_missing_peer, fresh_key, randn,
                      triton_config)

pytestmark = pytest.mark.gpu

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
if len(GPUS) < 2:
  pytest.skip("needs 2 NVIDIA GPUs", allow_module_level=True)

TRITON = triton_config()
TF32 = 5e-3  # tf32 products: relative error ~3e-4, summed over K
AG = lambda x, w: lax.all_gather(x, "x", axis=0, tiled=True) @ w


def _mesh():
  return jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=GPUS[:2])


def _pair(mesh, m_total, k, n_total, dtype):
  k1, k2 = jax.random.split(fresh_key())
  x = jax.device_put(randn(k1, (m_total, k), dtype), NamedSharding(mesh, P("x")))
  w = jax.device_put((randn(k2, (k, n_total), np.float32) / np.sqrt(k)).astype(dtype),
                     NamedSharding(mesh, P(None, "x")))
  return x, w


def _programs(mesh, config=TRITON):
  specs, out = (P("x"), P(None, "x")), P(None, "x")
  unfused = jax.jit(jax.shard_map(AG, mesh=mesh, in_specs=specs, out_specs=out))
  fused = ao.jit(jax.shard_map(AG, mesh=mesh, in_specs=specs, out_specs=out), overlap_config=config)
  return unfused, fused


SHAPES = [(256, 1024, 512), (600, 1024, 1280), (2000, 2048, 2000), (4096, 8192, 8192),
          (16384, 8192, 28672)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, np.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_unfused(dtype, shape):
  if dtype == np.float32 and shape[0] * shape[2] > 4096 * 8192:
    pytest.skip("f32 checked on the smaller shapes")
  mesh = _mesh()
  unfused, fused = _programs(mesh)
  report = fused.explain(*_pair(mesh, *shape, dtype))
  assert report.matches[0].impl.startswith("triton kernel"), str(report)
  for _ in range(2):  # fresh inputs every check
    x, w = _pair(mesh, *shape, dtype)
    got, want = fused(x, w), unfused(x, w)
    if dtype == np.float32:
      assert_close(got, want, np.float32, factor=TF32 / 2e-5)
    else:
      assert_close(got, want, dtype)


@pytest.mark.parametrize("shape", [(600, 1024, 1280), (4096, 2048, 4096)], ids=str)
def test_every_element_written_and_gathered_returned(shape):
  from jax_autooverlap.backends import triton as tb
  from jax_autooverlap.tuning.select import default_kernel
  mesh = _mesh()
  m_total, k, n_total = shape
  x, w = _pair(mesh, m_total, k, n_total, jnp.bfloat16)

  def body(x, w):  # outputs zeroed before the launch: unwritten elements stay 0
    return tb.ag_gemm(x, w, axis_name="x", mesh=mesh, kernel=default_kernel(jnp.bfloat16),
                      out_dtype=jnp.bfloat16, return_gathered=True, timeout_s=10.0, poison=True)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(None, "x")),
                            out_specs=(P(None, "x"), P("x"))))
  out, gathered = f(x, w)
  unfused, _ = _programs(mesh)
  want = np.asarray(unfused(x, w), np.float32)
  got = np.asarray(out, np.float32)
  assert not np.any((got == 0) & (want != 0)), "kernel left output elements unwritten"
  assert_close(got, want, jnp.bfloat16)
  for dev in range(2):  # every device returns the whole gathered x
    np.testing.assert_array_equal(np.asarray(gathered[dev * m_total:(dev + 1) * m_total]),
                                  np.asarray(x))


def test_back_to_back_calls_and_scan_are_stable():
  mesh = _mesh()
  unfused, fused = _programs(mesh)
  x, w = _pair(mesh, 1024, 1024, 1024, jnp.bfloat16)
  first = assert_repeat_calls_identical(fused, (x, w))
  assert_close(first, unfused(x, w), jnp.bfloat16)
  assert_scan_runs_the_kernel(AG, (1024, 512), (x, w), TRITON, mesh=mesh,
                              in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))


def test_kernel_among_many_ops_runs_repeatedly():
  """A fused op among >= 5 other GPU ops, which XLA turns into a CUDA graph by default."""
  mesh = _mesh()
  x, w = _pair(mesh, 2048, 1024, 2048, jnp.bfloat16)

  def block(x, w):  # fusion, kernel, then 3x (fusion, cuBLAS matmul), fusion
    h = lax.all_gather(x * 2 + 1, "x", axis=0, tiled=True) @ w
    for _ in range(3):
      h = (jax.nn.gelu(h) @ w) / 32
    return h

  kw = dict(mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))
  unfused, fused = jax.jit(jax.shard_map(block, **kw)), ao.jit(jax.shard_map(block, **kw),
                                                               overlap_config=TRITON)
  assert fused.explain(x, w).matches[0].impl.startswith("triton kernel")
  want = unfused(x, w)
  for _ in range(3):  # graphs are instantiated on a program's second run
    assert_close(fused(x, w), want, jnp.bfloat16)
  # Inside an outer jax.jit, default config: the first call measures the shape, runs the winner.
  auto = ao.jit(jax.shard_map(block, **kw))
  outer = jax.jit(lambda x, w: auto(x, w) + 0)
  for _ in range(3):
    assert_close(outer(x, w), want, jnp.bfloat16)


def test_command_buffers_off():
  check_command_buffers_off('lambda x, w: lax.all_gather(x, "x", axis=0, tiled=True) @ w',
                            'P("x")', 'P(None, "x")', 'P(None, "x")', (1024, 512))


def test_missing_peer_times_out_with_error():
  check_missing_peer('ao.ag_matmul(x, w, "x", config=cfg)', (1024, 512), 'P("x")', 'P(None, "x")',
                     'P(None, "x")', "ag_matmul")
