"""The one call site of the Triton kernels: host-side set-up and `jax_triton.triton_call`.

Builds, at trace time, everything a kernel needs that is per device: the
symmetric workspace addresses of the GPUs in this device's group (as a
constant table indexed by the group id computed from the other mesh axes) and
the device's rank (lax.axis_index).  The workspace addresses are the same in
every process (runtime/symmetric.py), so the table, and with it the program,
is the same in every process; the one per-process address, the error record,
is in each workspace's header.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_autooverlap import fp8
from jax_autooverlap._compat import import_jax_triton, scratch_out_type, vary_over, varying_axes
from jax_autooverlap.backends import gluon
from jax_autooverlap.backends.launch import (ag_grid, b_cols, copy_block, kernel_constants,
                                             operand_descs, pack, parity_bytes, partials_type,
                                             rs_grid, split_from, spread_rows, trace_out_type,
                                             with_scale)
from jax_autooverlap.runtime import topology, workspace
from jax_autooverlap.runtime.errors import register_op
from jax_autooverlap.tuning.config import KernelConfig


def _address_table(mesh, axis_name, world: int, addresses):
  """uint32 [groups, 2*(world+1)]: (lo, hi) of each member's workspace, then a reserved zero
  pair (it held the error record's address, which differs per process: now in the header).

  `addresses` are per flat mesh device; groups are in topology.axis_groups order.
  """
  flat_index = np.arange(np.asarray(mesh.devices).size).reshape(np.shape(mesh.devices))
  members = np.array(topology.axis_groups(flat_index, mesh.axis_names, axis_name), np.int64)
  table = np.zeros((members.shape[0], 2 * (world + 1)), np.uint32)
  for g, row in enumerate(members):
    for r, i in enumerate(row):
      table[g, 2 * r], table[g, 2 * r + 1] = addresses[i] & 0xFFFFFFFF, addresses[i] >> 32
  return table


def _table_row(table, mesh, axis_name):
  """This device's row of the table, built from scalar literals (no array constants, so
  bodies of remat/custom_vjp that hold the call can be re-traced without captured consts)."""
  rows = [jnp.stack([lax.full((), int(v), jnp.uint32) for v in row]) for row in table]
  if len(rows) == 1:
    return rows[0]
  gid = jnp.int32(0)
  for name in mesh.axis_names:
    if name != axis_name:
      gid = gid * mesh.shape[name] + lax.axis_index(name)
  return lax.select_n(gid, *rows)


def launch_ag_gemm(a, b, table_row, rank, *, world: int, kernel: KernelConfig, out_dtype,
                   return_gathered: bool, timeout_s: float, num_sms: int, op_id: int = 0,
                   compute_capability: int | None = None, poison: bool = False,
                   workspace_bytes: int | None = None, trace: bool = False):
  """The kernel call itself: a[m, K], b[K, N], table_row uint32[2*(world+1)], rank int32[1].

  fp8 operands: b is [N, K] (launch.b_cols) and table_row carries the epilogue scale
  (launch.with_scale).  workspace_bytes: the size of the workspaces the table points to
  (None: exactly what this launch needs; launch.parity_bytes).  poison (tests): zero the
  outputs before the launch, so that elements the kernel fails to write show up as exact zeros.
  trace (the loopback benchmark's --trace): also return the per-unit timeline (tl:
  kernels/tl_trace.py; gluon: kernels/gluon_trace.py).
  """
  if kernel.engine == "gluon":  # warp-specialised Gluon kernel, same protocol (backends/gluon.py)
    return gluon.launch_ag_gemm(a, b, table_row, rank, world=world, kernel=kernel,
                                out_dtype=out_dtype, return_gathered=return_gathered,
                                timeout_s=timeout_s, num_sms=num_sms, op_id=op_id,
                                compute_capability=compute_capability, poison=poison,
                                workspace_bytes=workspace_bytes, trace=trace)
  jt = import_jax_triton()
  from jax_autooverlap.kernels.ag_gemm import ag_gemm_kernel

  m, k = a.shape
  n = b_cols(a, b)
  tm, tn, num_comm, num_ctas, tiles = ag_grid(m, n, world, kernel, num_sms)
  parity = parity_bytes("ag_rows", world, a, n, out_dtype, workspace_bytes, "launch_ag_gemm")
  gathered_type = jax.ShapeDtypeStruct((world * m, k) if return_gathered else (16,), a.dtype)
  a_desc, b_desc = operand_descs(a, b, kernel)
  out, gathered, _, timeline, _ = jt.triton_call(
      a, a_desc, b_desc, table_row, rank, kernel=ag_gemm_kernel, name="ao_ag_gemm",
      zeroed_outputs=((0, 1) if poison else ()) + ((3,) if trace else ()),
      out_type=(jax.ShapeDtypeStruct((world * m, n), out_dtype), gathered_type,
                partials_type(kernel, tiles, k, "launch_ag_gemm"),
                trace_out_type(num_ctas, trace), scratch_out_type(num_ctas)),
      grid=(num_ctas,), num_warps=kernel.num_warps, num_stages=kernel.num_stages,
      compute_capability=compute_capability,
      M_SHARD=m, K=k, N=n, NUM_COMM=num_comm,
      **copy_block(m, k, kernel.block_m, world, num_comm, bool(kernel.pack_shards)),
      RETURN_GATHERED=return_gathered, SPLIT_K=kernel.split_k,
      SPLIT_FROM=split_from(kernel, tiles), PACK=pack(kernel, "ag", m, n), TRACE=trace,
      SPREAD=spread_rows(kernel, tiles, num_ctas),
      **kernel_constants(kernel, world, tm, num_ctas, timeout_s, op_id, parity))
  result = (out, gathered) if return_gathered else out
  return (result, timeline) if trace else result


def _group(mesh, axis_name, workspace_bytes: int):
  """Per-device set-up shared by the kernels: (table row, rank, world, the workspace).

  Everything here is the same in every process of the mesh: the workspace
  addresses (symmetric), its size and the SM count (the smallest, agreed at set-up).
  """
  world = mesh.shape[axis_name]
  ws = workspace.REGISTRY.workspace(mesh, axis_name, workspace_bytes)
  table = _address_table(mesh, axis_name, world, ws.addresses)
  rank = lax.axis_index(axis_name).astype(jnp.int32).reshape(1)
  return _table_row(table, mesh, axis_name), rank, world, ws


def _as_varying_like(x, inputs, axis_name):
  # jax-triton types its outputs as invariant; they vary like the inputs, and over the axis.
  return vary_over(x, set().union(*map(varying_axes, inputs)) | {axis_name})


def _fp8_operands(a, b, row, world: int, scale):
  """b K-major and the scale in the table row where the operands are fp8 (scale None: 1)."""
  if not fp8.is_fp8(a.dtype):
    return b, row
  scale = jnp.ones((), jnp.float32) if scale is None else scale
  return b.T, with_scale(row, scale, world)


def ag_gemm(a, b, *, axis_name, mesh, kernel: KernelConfig, out_dtype, return_gathered: bool,
            timeout_s: float, poison: bool = False, scale=None):
  """all_gather(a, rows) @ b on a group of GPUs; a[m, K], b[K, N] per device -> out[world*m, N]
  (fp8 operands: times scale, f32[])."""
  m, k = a.shape
  nbytes = workspace.kernel_bytes("ag_rows", mesh.shape[axis_name], m, k, b.shape[1], a.dtype,
                                  out_dtype)
  row, rank, world, ws = _group(mesh, axis_name, nbytes)
  b, row = _fp8_operands(a, b, row, world, scale)
  op_id = register_op(f"ag_matmul over axis {axis_name!r} (world {world}, a{[m, k]} @ "
                      f"b{[k, b.shape[1]]}, {np.dtype(a.dtype).name})")
  res = launch_ag_gemm(a, b, row, rank, world=world, kernel=kernel, out_dtype=out_dtype,
                       return_gathered=return_gathered, timeout_s=timeout_s, num_sms=ws.num_sms,
                       op_id=op_id, poison=poison, workspace_bytes=ws.nbytes)
  if return_gathered:
    return tuple(_as_varying_like(r, (a, b), axis_name) for r in res)
  return _as_varying_like(res, (a, b), axis_name)


def launch_gemm_rs(a, b, table_row, rank, *, world: int, kernel: KernelConfig, out_dtype,
                   timeout_s: float, num_sms: int, op_id: int = 0,
                   compute_capability: int | None = None, poison: bool = False,
                   workspace_bytes: int | None = None, trace: bool = False):
  """The kernel call itself: a[M, K], b[K, N] -> out[M / world, N] (summed over the group;
  fp8 operands, workspace_bytes, trace: as launch_ag_gemm)."""
  if kernel.engine == "gluon":  # warp-specialised Gluon kernel, same protocol (backends/gluon.py)
    return gluon.launch_gemm_rs(a, b, table_row, rank, world=world, kernel=kernel,
                                out_dtype=out_dtype, timeout_s=timeout_s, num_sms=num_sms,
                                op_id=op_id, compute_capability=compute_capability, poison=poison,
                                workspace_bytes=workspace_bytes, trace=trace)
  jt = import_jax_triton()
  from jax_autooverlap.kernels.gemm_rs import gemm_rs_kernel

  m, k = a.shape
  n = b_cols(a, b)
  m_out, tm, tn, num_ctas, tiles = rs_grid(m, n, world, kernel, num_sms)
  parity = parity_bytes("rs_rows", world, a, n, out_dtype, workspace_bytes, "launch_gemm_rs")
  a_desc, b_desc = operand_descs(a, b, kernel)
  packed = pack(kernel, "rs", m_out, n)
  out, _, timeline, _ = jt.triton_call(
      a_desc, b_desc, table_row, rank, kernel=gemm_rs_kernel, name="ao_gemm_rs",
      zeroed_outputs=((0,) if poison else ()) + ((2,) if trace else ()),
      out_type=(jax.ShapeDtypeStruct((m_out, n), out_dtype),
                partials_type(kernel, tiles, k, "launch_gemm_rs"),
                trace_out_type(num_ctas, trace), scratch_out_type(num_ctas)),
      grid=(num_ctas,), num_warps=kernel.num_warps, num_stages=kernel.num_stages,
      compute_capability=compute_capability,
      M=m, K=k, N=n, SPLIT_K=kernel.split_k, SPLIT_FROM=split_from(kernel, tiles),
      PACK=packed, TRACE=trace, SPREAD=spread_rows(kernel, tiles, num_ctas) if packed > 1 else 0,
      **kernel_constants(kernel, world, tm, num_ctas, timeout_s, op_id, parity))
  return (out, timeline) if trace else out


def gemm_rs(a, b, *, axis_name, mesh, kernel: KernelConfig, out_dtype, timeout_s: float,
            poison: bool = False, scale=None):
  """psum_scatter(a @ b, rows) on a group of GPUs; a[M, K], b[K, N] per device -> [M/world, N]
  (fp8 operands: each GPU's partial times its scale, f32[])."""
  m, k = a.shape
  n = b.shape[1]
  nbytes = workspace.kernel_bytes("rs_rows", mesh.shape[axis_name], m, k, n, a.dtype, out_dtype)
  row, rank, world, ws = _group(mesh, axis_name, nbytes)
  b, row = _fp8_operands(a, b, row, world, scale)
  op_id = register_op(f"matmul_rs over axis {axis_name!r} (world {world}, a{[m, k]} @ "
                      f"b{[k, n]}, {np.dtype(a.dtype).name})")
  out = launch_gemm_rs(a, b, row, rank, world=world, kernel=kernel, out_dtype=out_dtype,
                       timeout_s=timeout_s, num_sms=ws.num_sms, op_id=op_id, poison=poison,
                       workspace_bytes=ws.nbytes)
  return _as_varying_like(out, (a, b), axis_name)
