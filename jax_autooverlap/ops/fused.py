"""Differentiable fused cores on canonical 3-D operands, and the dispatch point.

Each core is a `custom_vjp` whose backward pass uses the dual fused op:
  d/da  AG(a) @ b      = RS(dout @ b^T)          (ag_rows -> rs_rows)
  d/da  RS(a @ b)      = AG(dout) @ b^T          (rs_rows -> ag_rows)
  d/db  a @ AG_K(b)    = RS_K(a^T @ dout)        (ag_k    -> rs_rows)
The other operand's gradient is a local matmul against the gathered value that
the forward already produced (the unfused program saves the same residual).

`_dispatch` is where platform-specific kernels plug in: it picks, per platform,
between the reference ring and the unfused program (and, on GPUs, the Triton
kernels once they exist), following the op's `OverlapConfig`.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
from jax import lax

from jax_autooverlap.ops import reference as ref
from jax_autooverlap.ops.reference import RingParams

_SWAP_MK = (0, 2, 1)


@dataclasses.dataclass(frozen=True)
class GpuPlan:
  """Everything the GPU kernel of one call needs besides its operands."""
  mesh: Any
  kernel: Any  # tuning.KernelConfig
  timeout_s: float


@dataclasses.dataclass(frozen=True)
class CoreParams:
  ring: RingParams
  impl: str  # resolved: "reference" | "unfused" | "triton" | "platform" (decided at lowering)
  return_gathered: bool = False
  gpu: GpuPlan | None = None
  config: Any = None  # the op's OverlapConfig, for planning the dual op of the backward pass
  mesh: Any = None

  def dual(self, op, a, b, dtype, return_gathered=False):
    """Params of the dual op run by the backward pass on operands a, b."""
    from jax_autooverlap.ops.planning import dual_params  # planning builds on this module
    return dual_params(op, a, b, self.ring, self.config, dtype, self.mesh, return_gathered)


def _dispatch(ring_fn, unfused_fn, a, b, cp: CoreParams, gpu_fn=None, need_gathered=True):
  if cp.impl == "reference":
    return ring_fn(a, b, cp.ring)
  if cp.impl == "unfused":
    return unfused_fn(a, b, cp.ring)
  if cp.impl == "triton":
    return gpu_fn(a, b, cp, need_gathered)
  # Platform unknown at trace time (no concrete mesh): the reference ring,
  # except on GPUs, where the unfused program (NCCL + cuBLAS) beats it.
  return lax.platform_dependent(
      a, b,
      cuda=lambda a, b: unfused_fn(a, b, cp.ring),
      rocm=lambda a, b: unfused_fn(a, b, cp.ring),
      default=lambda a, b: ring_fn(a, b, cp.ring))


def _ag_rows_triton(a, b, cp: CoreParams, need_gathered: bool):
  from jax_autooverlap.backends import triton as triton_backend
  res = triton_backend.ag_gemm(
      a[0], b[0], axis_name=cp.ring.axis_name, mesh=cp.gpu.mesh, kernel=cp.gpu.kernel,
      out_dtype=cp.ring.out_dtype, return_gathered=need_gathered, timeout_s=cp.gpu.timeout_s)
  out, gathered = res if need_gathered else (res, None)
  return out[None], (None if gathered is None else gathered[None])


def _mT(x):
  return lax.transpose(x, _SWAP_MK)


def _local_bmm(x, y, contract, dtype, precision):
  """[B,*,*] x [B,*,*] with the given contracting dims (one each) and batch dim 0."""
  return lax.dot_general(x, y, ((contract[0], contract[1]), ((0,), (0,))),
                         precision=precision, preferred_element_type=dtype)


# --- all_gather(a, rows) @ b -------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(2,))
def ag_rows(a, b, cp: CoreParams):
  out, gathered = _dispatch(ref.ag_rows_ring, ref.ag_rows_unfused, a, b, cp, _ag_rows_triton,
                            need_gathered=cp.return_gathered)
  return (out, gathered) if cp.return_gathered else out


def _ag_rows_fwd(a, b, cp):
  out, gathered = _dispatch(ref.ag_rows_ring, ref.ag_rows_unfused, a, b, cp, _ag_rows_triton)
  res = (gathered, b)
  return ((out, gathered) if cp.return_gathered else out), res


def _ag_rows_bwd(cp, res, ct):
  gathered, b = res
  dout, dgathered = ct if cp.return_gathered else (ct, None)
  bT = _mT(b)
  da = rs_rows(dout, bT, cp.dual("rs_rows", dout, bT, gathered.dtype))
  if dgathered is not None:
    da = da + lax.psum_scatter(dgathered, cp.ring.axis_name, scatter_dimension=1, tiled=True)
  db = _local_bmm(gathered, dout, ((1,), (1,)), b.dtype, cp.ring.precision)
  return da, db


ag_rows.defvjp(_ag_rows_fwd, _ag_rows_bwd)


# --- a @ all_gather(b, contracting) -----------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(2,))
def ag_k(a, b, cp: CoreParams):
  out, gathered = _dispatch(ref.ag_k_ring, ref.ag_k_unfused, a, b, cp)
  return (out, gathered) if cp.return_gathered else out


def _ag_k_fwd(a, b, cp):
  out, gathered = _dispatch(ref.ag_k_ring, ref.ag_k_unfused, a, b, cp)
  return ((out, gathered) if cp.return_gathered else out), (a, gathered)


def _ag_k_bwd(cp, res, ct):
  a, gathered = res
  dout, dgathered = ct if cp.return_gathered else (ct, None)
  da = _local_bmm(dout, gathered, ((2,), (2,)), a.dtype, cp.ring.precision)
  aT = _mT(a)
  db = rs_rows(aT, dout, cp.dual("rs_rows", aT, dout, gathered.dtype))
  if dgathered is not None:
    db = db + lax.psum_scatter(dgathered, cp.ring.axis_name, scatter_dimension=1, tiled=True)
  return da, db


ag_k.defvjp(_ag_k_fwd, _ag_k_bwd)


# --- psum_scatter(a @ b, rows) -----------------------------------------------

def _rs_rows_triton(a, b, cp: CoreParams, need_gathered: bool):
  from jax_autooverlap.backends import triton as triton_backend
  return triton_backend.gemm_rs(
      a[0], b[0], axis_name=cp.ring.axis_name, mesh=cp.gpu.mesh, kernel=cp.gpu.kernel,
      out_dtype=cp.ring.out_dtype, timeout_s=cp.gpu.timeout_s)[None]


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rs_rows(a, b, cp: CoreParams):
  return _dispatch(ref.rs_rows_ring, ref.rs_rows_unfused, a, b, cp, _rs_rows_triton)


def _rs_rows_fwd(a, b, cp):
  return rs_rows(a, b, cp), (a, b)


def _rs_rows_bwd(cp, res, dout):
  a, b = res
  bT = _mT(b)
  da, gathered_dout = ag_rows(dout, bT, cp.dual("ag_rows", dout, bT, a.dtype, return_gathered=True))
  db = _local_bmm(a, gathered_dout, ((1,), (1,)), b.dtype, cp.ring.precision)
  return da, db


rs_rows.defvjp(_rs_rows_fwd, _rs_rows_bwd)
