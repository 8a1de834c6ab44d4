"""The kernel config the GPU tests force, from AO_TEST_ENGINE and AO_TEST_WG_PARTITIONS.

Not in conftest.py: tests/gpu_two_process.py's workers import it too, and must not take a
test session's settings (conftest.py's XLA flags and tuning-cache directory) with it.
"""
import os


def forced_kernel_config():
  """AO_TEST_ENGINE=tl|gluon runs the kernels on that engine (else the tuner's pick: None),
  AO_TEST_WG_PARTITIONS=1 with gluon the warpgroup-partition GEMM+RS, AO_TEST_PACKED=1 the
  tl kernels with several shards per 128x128 row tile (KernelConfig.pack_shards: for steps
  whose shards have 64 rows or fewer, dividing 128), AO_TEST_SPLIT_K=S the tl kernels with
  every tile's k-blocks in S parts (KernelConfig.split_k) (as tests/gpu_two_process.py
  --engine / --wg-partitions / --packed / --split-k do)."""
  from jax_autooverlap.tuning.config import KernelConfig
  engine = os.environ.get("AO_TEST_ENGINE")
  wg = os.environ.get("AO_TEST_WG_PARTITIONS", "") == "1"
  if wg and engine != "gluon":
    raise ValueError("AO_TEST_WG_PARTITIONS=1 needs AO_TEST_ENGINE=gluon")
  split = int(os.environ.get("AO_TEST_SPLIT_K", "") or 1)
  if split > 1 and engine not in (None, "tl"):
    raise ValueError("AO_TEST_SPLIT_K needs the tl engine")
  if os.environ.get("AO_TEST_PACKED", "") == "1":
    if engine not in (None, "tl"):
      raise ValueError("AO_TEST_PACKED=1 needs the tl engine")
    return KernelConfig(engine="tl", block_m=128, block_n=128, num_warps=8, pack_shards=True,
                        split_k=split)
  if split > 1:
    return KernelConfig(engine="tl", split_k=split)
  return KernelConfig(engine=engine, wg_partitions=wg) if engine else None
