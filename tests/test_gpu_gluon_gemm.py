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


TILES = {"128x256": dict(), "64x256": dict(block_m=64, num_warps=4),
         "64x128": dict(block_m=64, block_n=128, num_warps=4)}


@pytest.mark.parametrize("dtype,tiles", [(jnp.bfloat16, t) for t in TILES] + [(jnp.float16, "128x256")],
                         ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("shape", [(4096, 8192, 4096), (1000, 1024, 1000), (128, 64, 256),
                                   (8192, 2048, 4096)], ids=lambda s: "x".join(map(str, s)))
def test_engine_gemm_matches_xla(dtype, shape, tiles):
  """Against XLA's f32-accumulated GEMM on fresh random inputs, and the same bits on a second
  call; 128-row tiles (two consumer warpgroups) and 64-row ones (one)."""
  from jax_autooverlap.backends.gluon import launch_gemm
  from jax_autooverlap.runtime import cuda
  from jax_autooverlap.tuning.config import KernelConfig
  m, k, n = shape
  k1, k2 = jax.random.split(fresh_key())
  a = jax.device_put(randn(k1, (m, k), dtype), GPUS[0])
  b = jax.device_put((randn(k2, (k, n), np.float32) / np.sqrt(k)).astype(dtype), GPUS[0])
  cfg = KernelConfig(engine="gluon", **TILES[tiles])
  f = jax.jit(lambda a, b: launch_gemm(a, b, kernel=cfg, out_dtype=dtype,
                                       num_sms=cuda.sm_count(GPUS[0].local_hardware_id)))
  got = f(a, b)
  assert_close(got, jnp.dot(a, b, preferred_element_type=jnp.float32), dtype)
  np.testing.assert_array_equal(np.asarray(f(a, b)), np.asarray(got))  # deterministic
