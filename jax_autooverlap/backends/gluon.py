"""Launches of the Gluon engine's kernels (KernelConfig.engine == "gluon", sm_90).

Same arguments and outputs as the `tl` launchers in backends/triton.py, which
hand over to these; the kernels keep the same workspace layout and protocol.
The grid and the per-call constants follow the `tl` launchers; what differs:
- the kernel runs num_warps = 8 warps for its consumer warpgroups plus one
  producer warp group (jax-triton launches all of them: _compat.py, fix 3);
- the operand ring has kernel.num_stages stages, the consumers' tile is
  block_m x block_n with block_m = 128 (one 64-row wgmma per warpgroup);
- AG+GEMM: the shard is pushed by a mover warp in each of the first
  kernel.num_comm CTAs, which all compute (backends/triton.py's ag_grid).
"""
from __future__ import annotations

import math
import os

import jax

from jax_autooverlap._compat import import_jax_triton, scratch_out_type
from jax_autooverlap.tuning.config import KernelConfig


def diag_bits() -> int:
  """AO_GLUON_DIAG: bits that switch parts of the Gluon kernels off, for the loopback benchmark's
  cost attribution only (results are wrong with some of them): ag 1 = no push by the movers,
  2 = no waits for peers' chunks; rs 1 = no release of pushed tiles, 2 = no peer partials
  summed, 4 = no prefetch of the first peer partial."""
  return int(os.environ.get("AO_GLUON_DIAG", "0"))


def trace_out_type(num_ctas: int, trace: bool):
  """The trace operand of a launch (kernels/gluon_trace.py): [num_ctas, 1 + SLOTS, 4] int64 where
  the launch records it (zeroed before: rows of tiles a CTA did not run stay 0), else a
  4-element placeholder the kernel never touches."""
  import numpy as np
  from jax_autooverlap.kernels import gluon_trace
  shape = (num_ctas, 1 + gluon_trace.SLOTS.value, gluon_trace.FIELDS.value) if trace else (4,)
  return jax.ShapeDtypeStruct(shape, np.int64)


def push_slice(k: int) -> int:
  """Columns of one AG push unit (kernels/gluon_ag_gemm.py): 512 (128 KB of a 128-row bf16 tile),
  or all of a narrower shard, a whole number of 64-column staging boxes."""
  return 512 if k > 512 else 64 * math.ceil(k / 64)


def launch_ag_gemm(a, b, table_row, rank, *, world: int, kernel: KernelConfig, out_dtype,
                   return_gathered: bool, timeout_s: float, num_sms: int, op_id: int = 0,
                   compute_capability: int | None = None, poison: bool = False,
                   trace: bool = False):
  """backends/triton.py's launch_ag_gemm, on the Gluon engine; trace: also return the
  consumers' per-tile timeline (kernels/gluon_trace.py; the loopback benchmark's --trace)."""
  from jax_autooverlap.backends.triton import ag_grid, kernel_constants
  from jax_autooverlap.kernels.gluon_ag_gemm import gluon_ag_gemm_kernel
  jt = import_jax_triton()
  m, k = a.shape
  n = b.shape[1]
  tm, tn, num_comm, num_ctas = ag_grid(m, n, world, kernel, num_sms)
  gathered_type = jax.ShapeDtypeStruct((world * m, k) if return_gathered else (16,), a.dtype)
  out, gathered, timeline, _ = jt.triton_call(
      a, b, table_row, rank, kernel=gluon_ag_gemm_kernel, name="ao_ag_gemm_gluon",
      zeroed_outputs=((0, 1) if poison else ()) + ((2,) if trace else ()),
      out_type=(jax.ShapeDtypeStruct((world * m, n), out_dtype), gathered_type,
                trace_out_type(num_ctas, trace), scratch_out_type(num_ctas)),
      grid=(num_ctas,), num_warps=kernel.num_warps, compute_capability=compute_capability,
      M_SHARD=m, K=k, N=n, KS=push_slice(k), NUM_COMM=num_comm, RETURN_GATHERED=return_gathered,
      STAGES=kernel.num_stages, DIAG=diag_bits(), TRACE=trace,
      **kernel_constants(kernel, world, tm, num_ctas, timeout_s, op_id))
  result = (out, gathered) if return_gathered else out
  return (result, timeline) if trace else result


def cluster_kernel_unsupported() -> str | None:
  """Why this triton cannot build kernels/gluon_gemm_mc.py (its Gluon has no TMA multicast
  before 3.7), or None."""
  import triton
  if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
    return f"Gluon TMA multicast needs triton >= 3.7 (this is {triton.__version__})"
  return None


def launch_gemm_cluster(a, b, *, block_m: int, block_n: int, stages: int, out_dtype,
                        num_sms: int, group_m: int = 8, compute_capability: int | None = None,
                        ctas: int = 2, setup_fence: bool = False):
  """The experiment of kernels/gluon_gemm_mc.py (triton >= 3.7): a[M, K] @ b[K, N] in 2-CTA
  clusters (B multicast), ping-pong warpgroups, a block_m x block_n tile per warpgroup
  (ctas=1: the same schedule without clusters)."""
  reason = cluster_kernel_unsupported()
  if reason:
    raise NotImplementedError(f"launch_gemm_cluster: {reason}")
  from jax_autooverlap.kernels.gluon_gemm_mc import WG_WARPS, gluon_gemm_mc_kernel
  jt = import_jax_triton()
  m, k = a.shape
  n = b.shape[1]
  if ctas not in (1, 2):
    raise ValueError(f"launch_gemm_cluster: ctas={ctas}; 1 or 2 CTAs per cluster")
  tiles = math.ceil(m / (ctas * block_m)) * math.ceil(n / block_n)
  clusters = min(num_sms // ctas, tiles)
  out, _ = jt.triton_call(
      a, b, kernel=gluon_gemm_mc_kernel, name="ao_gemm_gluon_mc",
      out_type=(jax.ShapeDtypeStruct((m, n), out_dtype), scratch_out_type(ctas * clusters)),
      grid=(clusters,), num_warps=int(WG_WARPS), num_ctas=ctas,
      compute_capability=compute_capability, M=m, K=k, N=n, BLOCK_M=block_m, BLOCK_N=block_n,
      BLOCK_K=64, GROUP_M=group_m, STAGES=stages, CLUSTERS=clusters,
      SETUP_FENCE=setup_fence)
  return out


def launch_gemm(a, b, *, kernel: KernelConfig, out_dtype, num_sms: int,
                compute_capability: int | None = None, trace: bool = False,
                setup_fence: bool = False):
  """The engine alone: a[M, K] @ b[K, N] (no communication; GPU tests and benchmarks).
  kernel.wg_partitions: the experiment of kernels/gluon_gemm_wg.py (no timeline); setup_fence:
  the experiment of gluon_engine.setup_fence."""
  from jax_autooverlap.kernels.gluon_gemm import gluon_gemm_kernel
  jt = import_jax_triton()
  m, k = a.shape
  n = b.shape[1]
  tiles = math.ceil(m / kernel.block_m) * math.ceil(n / kernel.block_n)
  num_ctas = min(num_sms, tiles)
  if kernel.wg_partitions:
    from jax_autooverlap.kernels.gluon_gemm_wg import WG_WARPS, gluon_gemm_wg_kernel
    if trace:
      raise ValueError("launch_gemm: wg_partitions=True records no timeline (trace=True)")
    out, _ = jt.triton_call(
        a, b, kernel=gluon_gemm_wg_kernel, name="ao_gemm_gluon_wg",
        out_type=(jax.ShapeDtypeStruct((m, n), out_dtype), scratch_out_type(num_ctas)),
        grid=(num_ctas,), num_warps=int(WG_WARPS), compute_capability=compute_capability,
        M=m, K=k, N=n, BLOCK_M=kernel.block_m, BLOCK_N=kernel.block_n, BLOCK_K=kernel.block_k,
        GROUP_M=kernel.group_m, STAGES=kernel.num_stages, NUM_CTAS=num_ctas)
    return out
  out, timeline, _ = jt.triton_call(
      a, b, kernel=gluon_gemm_kernel, name="ao_gemm_gluon",
      zeroed_outputs=(1,) if trace else (),
      out_type=(jax.ShapeDtypeStruct((m, n), out_dtype), trace_out_type(num_ctas, trace),
                scratch_out_type(num_ctas)),
      grid=(num_ctas,),
      num_warps=kernel.num_warps, compute_capability=compute_capability,
      M=m, K=k, N=n, BLOCK_M=kernel.block_m, BLOCK_N=kernel.block_n, BLOCK_K=kernel.block_k,
      GROUP_M=kernel.group_m, STAGES=kernel.num_stages, NUM_CTAS=num_ctas, TRACE=trace,
      SETUP_FENCE=setup_fence)
  return (out, timeline) if trace else out


def launch_gemm_rs(a, b, table_row, rank, *, world: int, kernel: KernelConfig, out_dtype,
                   timeout_s: float, num_sms: int, op_id: int = 0,
                   compute_capability: int | None = None, poison: bool = False,
                   trace: bool = False):
  """backends/triton.py's launch_gemm_rs, on the Gluon engine (trace: as launch_ag_gemm;
  kernel.wg_partitions: a consumer partition per warpgroup; every rank of the group must
  launch the same, its arrival counters count halves)."""
  wg_partitions = kernel.wg_partitions
  from jax_autooverlap.backends.triton import kernel_constants, rs_grid
  from jax_autooverlap.kernels.gluon_gemm_rs import gluon_gemm_rs_kernel
  jt = import_jax_triton()
  m, k = a.shape
  n = b.shape[1]
  m_out, tm, tn, num_ctas = rs_grid(m, n, world, kernel, num_sms)
  out, timeline, _ = jt.triton_call(
      a, b, table_row, rank, kernel=gluon_gemm_rs_kernel, name="ao_gemm_rs_gluon",
      zeroed_outputs=((0,) if poison else ()) + ((1,) if trace else ()),
      out_type=(jax.ShapeDtypeStruct((m_out, n), out_dtype), trace_out_type(num_ctas, trace),
                scratch_out_type(num_ctas)),
      grid=(num_ctas,), num_warps=kernel.num_warps // (2 if wg_partitions else 1),
      compute_capability=compute_capability,
      M=m, K=k, N=n, STAGES=kernel.num_stages, DIAG=diag_bits(), TRACE=trace,
      WG_PARTS=2 if wg_partitions else 1,
      **kernel_constants(kernel, world, tm, num_ctas, timeout_s, op_id))
  return (out, timeline) if trace else out
