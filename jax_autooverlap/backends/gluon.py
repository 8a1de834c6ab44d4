"""Launches of the Gluon engine's kernels (KernelConfig.engine == "gluon", sm_90).

Same arguments and outputs as the `tl` launchers in backends/triton.py, which
hand over to these; the kernels keep the same workspace layout and protocol.
The grid and the per-call constants follow the `tl` launchers; what differs:
- the kernel runs num_warps = block_m / 16 warps for its consumer warpgroups
  (8 for 128-row tiles, 4 for 64-row ones) plus one worker warp group
  (jax-triton launches all of them: _compat.py, fix 6);
- the operand ring has kernel.num_stages stages, the consumers' tile is
  block_m x block_n, one 64-row wgmma per warpgroup;
- AG+GEMM: the shard is pushed by a mover warp in each of the first
  kernel.num_comm CTAs, which all compute (backends/launch.py's ag_grid);
- the operands' TMA descriptors (a, b; the AG mover's view of the shard) are made
  on the host (`host_desc`): jax-triton encodes them with the buffers' addresses
  into each launch's parameters.  Made on the device they cost every CTA ~0.7 us
  each before its first load (kernel entry to the consumers' start: engine 3.4 ->
  2.0 us, fused AG 5.6 -> 2.7 us, one H200, docs/NOTES.md).  The outputs' and the
  workspace's descriptors are made on the device, by the partition that uses them.
"""
from __future__ import annotations

import math

import jax

from jax_autooverlap._compat import import_jax_triton, scratch_out_type
from jax_autooverlap.backends.launch import (ag_grid, b_cols, kernel_constants, operand_descs,
                                             parity_bytes, rs_grid, trace_out_type)
from jax_autooverlap.tuning.config import KernelConfig


def push_slice(k: int) -> int:
  """Columns of one AG push unit (kernels/gluon_ag_gemm.py): 512 (128 KB of a 128-row bf16 tile),
  or all of a narrower shard, a whole number of 64-column staging boxes."""
  return 512 if k > 512 else 64 * math.ceil(k / 64)


def _fewer_than_peers(pushes: int, pushers: int, world: int) -> bool:
  """Whether a pushing CTA pushes fewer tiles (units) than it has peers, on average: then it
  makes a push descriptor per tile (~0.7 us each) instead of one per peer up front
  (kernels/gluon_gemm_rs.py PUSH_DESC_PER_TILE, gluon_ag_gemm.py PUSH_DESC_PER_UNIT)."""
  return math.ceil(pushes / pushers) < world - 1


def _push_units(k: int, world: int, tm: int) -> int:
  """The AG mover's push units (kernels/gluon_ag_gemm.py _mover): tile rows x peers x column
  slices."""
  return tm * (world - 1) * math.ceil(k / push_slice(k))


def _gl_dtype(dtype):
  from triton.experimental.gluon import language as gl
  return {"bfloat16": gl.bfloat16, "float16": gl.float16, "float32": gl.float32,
          "float8_e4m3fn": gl.float8e4nv, "float8_e5m2": gl.float8e5}[jax.numpy.dtype(dtype).name]


def _layout(block_shape, dtype):
  """The shared-memory layout of a Gluon kernel's descriptor (as gluon_engine.make_desc's)."""
  from jax_autooverlap.kernels.gluon_engine import shared_layout
  return shared_layout(list(block_shape), _gl_dtype(dtype))


def host_desc(x, shape, strides, block_shape):
  """A descriptor of x made on the host (launch.operand_descs), in a Gluon kernel's layout."""
  return import_jax_triton().TensorDescriptor(x, tuple(shape), tuple(strides),
                                              tuple(block_shape), layout=_layout(block_shape,
                                                                                 x.dtype))


def host_descs(a, b, kernel: KernelConfig):
  """launch.operand_descs in the Gluon kernels' layouts."""
  return operand_descs(a, b, kernel, _layout)


def launch_ag_gemm(a, b, table_row, rank, *, world: int, kernel: KernelConfig, out_dtype,
                   return_gathered: bool, timeout_s: float, num_sms: int, op_id: int = 0,
                   compute_capability: int | None = None, poison: bool = False,
                   trace: bool = False, workspace_bytes: int | None = None):
  """backends/triton.py's launch_ag_gemm, on the Gluon engine; trace: also return the
  consumers' per-tile timeline (kernels/gluon_trace.py; the loopback benchmark's --trace)."""
  from jax_autooverlap.kernels.gluon_ag_gemm import BOX as MOVER_BOX
  from jax_autooverlap.kernels.gluon_ag_gemm import box_cols, gluon_ag_gemm_kernel
  jt = import_jax_triton()
  m, k = a.shape
  n = b_cols(a, b)
  tm, tn, num_comm, num_ctas, _ = ag_grid(m, n, world, kernel, num_sms)
  parity = parity_bytes("ag_rows", world, a, n, out_dtype, workspace_bytes, "launch_ag_gemm")
  gathered_type = jax.ShapeDtypeStruct((world * m, k) if return_gathered else (16,), a.dtype)
  a_desc, b_desc = host_descs(a, b, kernel)
  box = (1, MOVER_BOX.value, box_cols(_gl_dtype(a.dtype)))  # the mover's staging box
  a3_desc = host_desc(a, (1, m, k), (m * k, k, 1), box)
  out, gathered, timeline, _ = jt.triton_call(
      a_desc, a3_desc, b_desc, table_row, rank, kernel=gluon_ag_gemm_kernel,
      name="ao_ag_gemm_gluon",
      zeroed_outputs=((0, 1) if poison else ()) + ((2,) if trace else ()),
      out_type=(jax.ShapeDtypeStruct((world * m, n), out_dtype), gathered_type,
                trace_out_type(num_ctas, trace), scratch_out_type(num_ctas)),
      grid=(num_ctas,), num_warps=kernel.num_warps, compute_capability=compute_capability,
      M_SHARD=m, K=k, N=n, KS=push_slice(k), NUM_COMM=num_comm, RETURN_GATHERED=return_gathered,
      STAGES=kernel.num_stages, TRACE=trace,
      PUSH_DESC_PER_UNIT=_fewer_than_peers(_push_units(k, world, tm), num_comm, world),
      **kernel_constants(kernel, world, tm, num_ctas, timeout_s, op_id, parity))
  result = (out, gathered) if return_gathered else out
  return (result, timeline) if trace else result


def launch_gemm(a, b, *, kernel: KernelConfig, out_dtype, num_sms: int,
                compute_capability: int | None = None, trace: bool = False):
  """The engine alone: a[M, K] @ b[K, N] (no communication; GPU tests and benchmarks; fp8
  operands: b is [N, K] and the product is not scaled)."""
  if kernel.wg_partitions:
    raise ValueError("launch_gemm: wg_partitions=True; warpgroup partitions exist for GEMM+RS "
                     "only (launch_gemm_rs)")
  from jax_autooverlap.kernels.gluon_gemm import gluon_gemm_kernel
  jt = import_jax_triton()
  m, k = a.shape
  n = b_cols(a, b)
  tiles = math.ceil(m / kernel.block_m) * math.ceil(n / kernel.block_n)
  num_ctas = min(num_sms, tiles)
  a_desc, b_desc = host_descs(a, b, kernel)
  out, timeline, _ = jt.triton_call(
      a_desc, b_desc, kernel=gluon_gemm_kernel, name="ao_gemm_gluon",
      zeroed_outputs=(1,) if trace else (),
      out_type=(jax.ShapeDtypeStruct((m, n), out_dtype), trace_out_type(num_ctas, trace),
                scratch_out_type(num_ctas)),
      grid=(num_ctas,),
      num_warps=kernel.num_warps, compute_capability=compute_capability,
      M=m, K=k, N=n, BLOCK_M=kernel.block_m, BLOCK_N=kernel.block_n, BLOCK_K=kernel.block_k,
      GROUP_M=kernel.group_m, STAGES=kernel.num_stages, NUM_CTAS=num_ctas, TRACE=trace)
  return (out, timeline) if trace else out


def launch_gemm_rs(a, b, table_row, rank, *, world: int, kernel: KernelConfig, out_dtype,
                   timeout_s: float, num_sms: int, op_id: int = 0,
                   compute_capability: int | None = None, poison: bool = False,
                   trace: bool = False, workspace_bytes: int | None = None):
  """backends/triton.py's launch_gemm_rs, on the Gluon engine (trace: as launch_ag_gemm;
  kernel.wg_partitions: a consumer partition per warpgroup; every rank of the group must
  launch the same, its arrival counters count halves)."""
  wg_partitions = kernel.wg_partitions
  from jax_autooverlap.kernels.gluon_gemm_rs import gluon_gemm_rs_kernel
  jt = import_jax_triton()
  m, k = a.shape
  n = b_cols(a, b)
  m_out, tm, tn, num_ctas, _ = rs_grid(m, n, world, kernel, num_sms)
  parity = parity_bytes("rs_rows", world, a, n, out_dtype, workspace_bytes, "launch_gemm_rs")
  a_desc, b_desc = host_descs(a, b, kernel)
  out, timeline, _ = jt.triton_call(
      a_desc, b_desc, table_row, rank, kernel=gluon_gemm_rs_kernel, name="ao_gemm_rs_gluon",
      zeroed_outputs=((0,) if poison else ()) + ((1,) if trace else ()),
      out_type=(jax.ShapeDtypeStruct((m_out, n), out_dtype), trace_out_type(num_ctas, trace),
                scratch_out_type(num_ctas)),
      grid=(num_ctas,), num_warps=kernel.num_warps // (2 if wg_partitions else 1),
      compute_capability=compute_capability,
      M=m, K=k, N=n, STAGES=kernel.num_stages, TRACE=trace,
      WG_PARTS=2 if wg_partitions else 1,
      PUSH_DESC_PER_TILE=_fewer_than_peers((world - 1) * tm * tn, num_ctas, world),
      **kernel_constants(kernel, world, tm, num_ctas, timeout_s, op_id, parity))
  return (out, timeline) if trace else out
