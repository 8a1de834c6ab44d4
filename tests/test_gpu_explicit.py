"""Explicit-sharding programs (no shard_map) reach the GPU kernels (marked gpu; skipped without
2 GPUs): ao.jit of a sequence-parallel MLP written with reshard / out_sharding runs the Triton
AG+GEMM and GEMM+RS kernels and matches jax.jit, forward and value_and_grad step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P, reshard

import jax_autooverlap as ao
from conftest import assert_close, fresh_key, randn

pytestmark = pytest.mark.gpu

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
if len(GPUS) < 2:
  pytest.skip("needs 2 NVIDIA GPUs", allow_module_level=True)

TRITON = ao.OverlapConfig(impl="triton")
M, K, N = 4096, 4096, 8192


def mlp(x, w_in, w_out):
  h = jax.nn.gelu(reshard(x, P()) @ w_in)
  return jnp.matmul(h, w_out, out_sharding=P("tp", None))


def _inputs():
  ks = jax.random.split(fresh_key(), 3)
  x = jax.device_put(randn(ks[0], (M, K), jnp.bfloat16), P("tp", None))
  w_in = jax.device_put((randn(ks[1], (K, N), np.float32) / np.sqrt(K)).astype(jnp.bfloat16),
                        P(None, "tp"))
  w_out = jax.device_put((randn(ks[2], (N, K), np.float32) / np.sqrt(N)).astype(jnp.bfloat16),
                         P("tp", None))
  return x, w_in, w_out


def test_explicit_mlp_runs_the_kernels():
  mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Explicit,), devices=GPUS[:2])
  with jax.set_mesh(mesh):
    args = _inputs()
    report = ao.explain(mlp, *args, overlap_config=TRITON)
    assert [m.kind for m in report.fused] == ["ag_matmul", "matmul_rs"], str(report)
    assert all(m.impl.startswith("triton kernel") for m in report.fused), str(report)
    fused = ao.jit(mlp, overlap_config=TRITON)
    assert "triton_kernel_call" in fused.lower(*args).as_text()
    for _ in range(3):  # fresh inputs, repeated calls
      args = _inputs()
      got, want = fused(*args), jax.jit(mlp)(*args)
      assert got.sharding.spec == want.sharding.spec
      assert_close(got, want, jnp.bfloat16)
    step = jax.value_and_grad(lambda *a: jnp.mean(mlp(*a).astype(np.float32) ** 2),
                              argnums=(0, 1, 2))
    got, want = ao.jit(step)(*args), jax.jit(step)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert_close(g, w, jnp.bfloat16, factor=2)
