"""The Gluon engine's plain GEMM on one sm_90 GPU (marked gpu; skipped elsewhere).

The fused Gluon kernels' compute path without communication, against XLA's
GEMM on fresh random inputs, with full and ragged tiles; the fused kernels
themselves run in tests/test_gpu_loopback.py (one GPU) and the two-GPU tests
(JAX_AUTOOVERLAP_ENGINE=gluon).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, fresh_key, randn

pytestmark = pytest.mark.gpu

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
if not GPUS or str(getattr(GPUS[0], "compute_capability", "")) != "9.0":
  pytest.skip("needs an sm_90 NVIDIA GPU (Hopper)", allow_module_level=True)


def _check_engine_gemm(shape, dtype, cfg, **launch):
  """The engine's GEMM under cfg against XLA's f32-accumulated GEMM on fresh random inputs, and
  the same bits on a second call."""
  from jax_autooverlap.backends.gluon import launch_gemm
  from jax_autooverlap.runtime import cuda
  m, k, n = shape
  k1, k2 = jax.random.split(fresh_key())
  a = jax.device_put(randn(k1, (m, k), dtype), GPUS[0])
  b = jax.device_put((randn(k2, (k, n), np.float32) / np.sqrt(k)).astype(dtype), GPUS[0])
  f = jax.jit(lambda a, b: launch_gemm(a, b, kernel=cfg, out_dtype=dtype, **launch,
                                       num_sms=cuda.sm_count(GPUS[0].local_hardware_id)))
  got = f(a, b)
  assert_close(got, jnp.dot(a, b, preferred_element_type=jnp.float32), dtype)
  np.testing.assert_array_equal(np.asarray(f(a, b)), np.asarray(got))  # deterministic


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(4096, 8192, 4096), (1000, 1024, 1000), (128, 64, 256),
                                   (8192, 2048, 4096)], ids=lambda s: "x".join(map(str, s)))
def test_engine_gemm_matches_xla(dtype, shape):
  from jax_autooverlap.tuning.config import KernelConfig
  _check_engine_gemm(shape, dtype, KernelConfig(engine="gluon"))


@pytest.mark.parametrize("shape", [(4096, 8192, 4096), (1000, 1024, 1000), (128, 64, 256),
                                   (8192, 2048, 4096)], ids=lambda s: "x".join(map(str, s)))
def test_engine_gemm_with_warpgroup_partitions_matches_xla(shape):
  """kernels/gluon_gemm_wg.py (each consumer warpgroup its own partition; an experiment)."""
  from jax_autooverlap.tuning.config import KernelConfig
  _check_engine_gemm(shape, jnp.bfloat16, KernelConfig(engine="gluon", wg_partitions=True))


@pytest.mark.parametrize("shape", [(4096, 8192, 4096), (1000, 1024, 1000), (128, 64, 256),
                                   (8192, 2048, 4096)], ids=lambda s: "x".join(map(str, s)))
def test_engine_gemm_with_one_setup_fence_matches_xla(shape):
  """gluon_engine.setup_fence (one proxy fence before warp_specialize instead of one per k-block
  in each loop; an experiment)."""
  from jax_autooverlap.tuning.config import KernelConfig
  _check_engine_gemm(shape, jnp.bfloat16, KernelConfig(engine="gluon"), setup_fence=True)


def _check_cluster_gemm(shape, tile, **launch):
  """kernels/gluon_gemm_mc.py (triton >= 3.7) under launch against XLA's GEMM, fresh random
  inputs, and the same bits on a second call."""
  from jax_autooverlap.backends.gluon import cluster_kernel_unsupported, launch_gemm_cluster
  if cluster_kernel_unsupported():
    pytest.skip(cluster_kernel_unsupported())
  from jax_autooverlap.runtime import cuda
  m, k, n = shape
  bm, bn, stages = tile
  k1, k2 = jax.random.split(fresh_key())
  a = jax.device_put(randn(k1, (m, k), jnp.bfloat16), GPUS[0])
  b = jax.device_put((randn(k2, (k, n), np.float32) / np.sqrt(k)).astype(jnp.bfloat16), GPUS[0])
  f = jax.jit(lambda a, b: launch_gemm_cluster(
      a, b, block_m=bm, block_n=bn, stages=stages, out_dtype=jnp.bfloat16, **launch,
      num_sms=cuda.sm_count(GPUS[0].local_hardware_id)))
  got = f(a, b)
  assert_close(got, jnp.dot(a, b, preferred_element_type=jnp.float32), jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(f(a, b)), np.asarray(got))


@pytest.mark.parametrize("ctas", [2, 1], ids=["cluster", "no_cluster"])
@pytest.mark.parametrize("tile", [(128, 128, 5), (64, 256, 4)], ids=lambda t: "{}x{}-s{}".format(*t))
@pytest.mark.parametrize("shape", [(4096, 8192, 4096), (1000, 1024, 1000), (128, 64, 256),
                                   (8192, 2048, 4096), (640, 512, 384)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cluster_engine_matches_xla(shape, tile, ctas):
  """kernels/gluon_gemm_mc.py (2-CTA clusters, B multicast, ping-pong warpgroups; ctas=1: the
  same schedule without clusters): full and ragged cluster tiles, one k-block, fewer tiles than
  clusters, odd tile counts per cluster (one warpgroup idle at the end), repeat bit-identical."""
  _check_cluster_gemm(shape, tile, ctas=ctas)


@pytest.mark.parametrize("ctas", [2, 1], ids=["cluster", "no_cluster"])
@pytest.mark.parametrize("shape", [(4096, 8192, 4096), (1000, 1024, 1000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cluster_engine_with_one_setup_fence_matches_xla(shape, ctas):
  """The cluster experiment with gluon_engine.setup_fence (no proxy fences in the loops)."""
  _check_cluster_gemm(shape, (128, 128, 5), ctas=ctas, setup_fence=True)
