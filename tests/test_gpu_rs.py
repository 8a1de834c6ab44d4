"""Fused GEMM+ReduceScatter Triton kernel and a training step on NVIDIA GPUs (marked gpu).

Fresh random inputs for every check; reference: the unfused JAX program
(dot_general + psum_scatter, cuBLAS + NCCL).
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
RS = lambda x, w: lax.psum_scatter(x @ w, "x", scatter_dimension=0, tiled=True)


def _mesh():
  return jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=GPUS[:2])


def _pair(mesh, m, k, n, dtype):
  k1, k2 = jax.random.split(fresh_key())
  x = jax.device_put(randn(k1, (m, k), dtype), NamedSharding(mesh, P(None, "x")))
  w = jax.device_put((randn(k2, (k, n), np.float32) / np.sqrt(k)).astype(dtype),
                     NamedSharding(mesh, P("x")))
  return x, w


def _programs(mesh, config=TRITON):
  kw = dict(mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x"))
  return jax.jit(jax.shard_map(RS, **kw)), ao.jit(jax.shard_map(RS, **kw), overlap_config=config)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, np.float32])
@pytest.mark.parametrize("shape", [(256, 1024, 512), (600, 2048, 1280), (4096, 8192, 8192),
                                   (16384, 8192, 8192)], ids=lambda s: "x".join(map(str, s)))
def test_matches_unfused_and_is_deterministic(dtype, shape):
  if dtype == np.float32 and shape[0] * shape[2] > 4096 * 8192:
    pytest.skip("f32 checked on the smaller shapes")
  mesh = _mesh()
  unfused, fused = _programs(mesh)
  report = fused.explain(*_pair(mesh, *shape, dtype))
  assert report.matches[0].impl.startswith("triton kernel"), str(report)
  for _ in range(2):
    x, w = _pair(mesh, *shape, dtype)
    got = fused(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fused(x, w)))  # bit-identical
    assert_close(got, unfused(x, w), dtype, factor=(5e-3 / 2e-5) if dtype == np.float32 else 1.0)


def test_every_element_written_and_repeat_calls_identical():
  from jax_autooverlap.backends import triton as tb
  from jax_autooverlap.tuning.select import default_kernel
  mesh = _mesh()
  x, w = _pair(mesh, 600, 2048, 1280, jnp.bfloat16)

  def body(x, w):  # output zeroed before the launch: unwritten elements stay 0
    return tb.gemm_rs(x, w, axis_name="x", mesh=mesh, kernel=default_kernel(jnp.bfloat16),
                      out_dtype=jnp.bfloat16, timeout_s=10.0, poison=True)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x")))
  unfused, fused = _programs(mesh)
  want = np.asarray(unfused(x, w), np.float32)
  got = np.asarray(f(x, w), np.float32)
  assert not np.any((got == 0) & (want != 0)), "kernel left output elements unwritten"
  assert_close(got, want, jnp.bfloat16)
  assert_repeat_calls_identical(fused, (x, w))


def test_training_step_two_layer_mlp():
  """jax.grad of a column-parallel (AG+GEMM) / row-parallel (GEMM+RS) MLP equals jax.jit's."""
  mesh = _mesh()
  ks = jax.random.split(fresh_key(), 4)
  tokens, hidden, ffn = 2048, 1024, 4096
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  x = put(randn(ks[0], (tokens, hidden), jnp.bfloat16), P("x"))
  w1 = put((randn(ks[1], (hidden, ffn), np.float32) / 32).astype(jnp.bfloat16), P(None, "x"))
  w2 = put((randn(ks[2], (ffn, hidden), np.float32) / 64).astype(jnp.bfloat16), P("x"))
  ct = randn(ks[3], (tokens, hidden), np.float32)

  def mlp(x, w1, w2):
    h = jax.nn.gelu(lax.all_gather(x, "x", axis=0, tiled=True) @ w1)
    return lax.psum_scatter(h @ w2, "x", scatter_dimension=0, tiled=True)

  block = jax.shard_map(mlp, mesh=mesh, in_specs=(P("x"), P(None, "x"), P("x")), out_specs=P("x"))
  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct)
  # value and grads: with grad alone the forward GEMM+RS output would be dead code
  grad = lambda f: jax.value_and_grad(loss(f), argnums=(0, 1, 2))
  # The training step under ao.jit (outermost): the inner fused block's forward runs both kernels.
  fused = ao.jit(block, overlap_config=TRITON)
  impls = [m.impl.split(" (")[0] for m in fused.explain(x, w1, w2).matches]
  assert impls == ["triton kernel"] * 2, impls
  step = ao.jit(grad(fused))
  assert step.lower(x, w1, w2).as_text().count("triton_kernel_call") >= 2
  want = jax.jit(grad(block))(x, w1, w2)
  for _ in range(3):  # CUDA graphs of the other ops are instantiated on the second run
    for g, r in zip(jax.tree.leaves(step(x, w1, w2)), jax.tree.leaves(want)):
      assert_close(g, r, jnp.bfloat16)
  # Under the user's own jax.jit the kernels run too (forced); with the default config the first
  # call measures each shape and runs what it chose: the same results either way.
  assert "triton_kernel_call" in jax.jit(grad(fused)).lower(x, w1, w2).as_text()
  auto = ao.jit(block)
  for f in (jax.jit(grad(fused)), jax.jit(grad(auto))):
    for g, r in zip(jax.tree.leaves(f(x, w1, w2)), jax.tree.leaves(want)):
      assert_close(g, r, jnp.bfloat16)
  assert not ao.explain(jax.jit(grad(auto)), x, w1, w2).pending  # measured on that first call


def test_scan_with_default_flags_runs_the_kernel_in_the_body():
  mesh = _mesh()
  x, w = _pair(mesh, 1024, 2048, 1024, jnp.bfloat16)
  assert_scan_runs_the_kernel(RS, (512, 1024), (x, w), TRITON, mesh=mesh,
                              in_specs=(P(None, "x"), P("x")), out_specs=P("x"))


def test_command_buffers_off_repeat_calls_and_scan():
  check_command_buffers_off('lambda x, w: lax.psum_scatter(x @ w, "x", scatter_dimension=0, '
                            'tiled=True)', 'P(None, "x")', 'P("x")', 'P("x")', (512, 1024))


def test_missing_peer_times_out_with_error():
  check_missing_peer('ao.matmul_rs(x, w, "x", config=cfg)', (512, 1024), 'P(None, "x")', 'P("x")',
                     'P("x")', "matmul_rs")
