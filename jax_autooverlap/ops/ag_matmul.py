"""`ag_matmul`: all_gather -> dot_general as one fused op, everything it runs in one place.

    ag_matmul(x, w, axis, gather_dim=g) == dot_general(all_gather(x, axis, axis=g, tiled=True), w)

for any dot_general dimension numbers (or with the gather on w), by bringing
the operands to the canonical [B, M, K] x [B, K, N] form (ops/canonical.py).
Two canonical cores:
  ag_rows: a[B, m, K] gathered on its rows, b[B, K, N]   -> out[B, n*m, N], gathered a
  ag_k:    a[B, M, n*k], b[B, k, N] gathered on K (FSDP) -> out[B, M, N],  gathered b
Implementations (ops/registry.py): the reference ring (any platform), the
unfused program, and for ag_rows the GPU kernel (backends/triton.py).
VJPs use the dual op (ops/matmul_rs.py's rs_rows):
  d/da  AG(a) @ b      = RS(dout @ b^T)
  d/db  a @ AG_K(b)    = RS_K(a^T @ dout)
the other operand's gradient being a local matmul against the gathered value
the forward produced (the unfused program saves the same residual).

fp8 operands (both float8_e4m3fn / float8_e5m2) with per-tensor scales: the
shard moves as fp8 bytes and the product is scaled in f32 before the output
cast (ops/scaled.py says what the backward computes).
"""
from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_autooverlap.backends import triton as triton_backend
from jax_autooverlap.ops import canonical as cf
from jax_autooverlap.ops import registry, ring, scaled
from jax_autooverlap.ops.dims import DotDims
from jax_autooverlap.ops.planning import CoreParams, dual_params, op_params
from jax_autooverlap.ops.ring import RingParams
from jax_autooverlap.tuning.config import OverlapConfig, as_overlap_config


# --- ag_rows: all_gather(a, rows) @ b -------------------------------------------------------

def _ag_rows_ring(a, b, p: RingParams, scale=None):
  n = p.axis_size
  perm = ring.from_next(p)
  parts = [lax.slice_in_dim(a, lo, lo + ln, axis=1) for lo, ln in ring.pieces(a.shape[1], p.chunks)]
  outs, gathered = [], []
  for step in range(n):
    # Issue the next step's transfers before this step's matmuls.
    nxt = [lax.ppermute(x, p.axis_name, perm) for x in parts] if step < n - 1 else None
    outs.append(jnp.concatenate([ring.bmm(x, b, p, scale=scale) for x in parts], axis=1))
    gathered.append(jnp.concatenate(parts, axis=1))
    parts = nxt
  return ring.gather_rows(outs, 1, p), ring.gather_rows(gathered, 1, p)


def _ag_rows_unfused(a, b, p: RingParams, scale=None):
  g = lax.all_gather(a, p.axis_name, axis=1, tiled=True)
  return ring.bmm(g, b, p, scale=scale), g


def _ag_rows_kernel(a, b, cp: CoreParams, need_gathered: bool, scale=None):
  res = triton_backend.ag_gemm(
      a[0], b[0], axis_name=cp.ring.axis_name, mesh=cp.gpu.mesh, kernel=cp.gpu.kernel,
      out_dtype=cp.ring.out_dtype, return_gathered=need_gathered, timeout_s=cp.gpu.timeout_s,
      scale=scale)
  out, gathered = res if need_gathered else (res, None)
  return out[None], (None if gathered is None else gathered[None])


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def ag_rows(a, b, cp: CoreParams, scale=None):
  out, gathered = registry.dispatch("ag_rows", a, b, cp, cp.return_gathered, scale)
  return (out, gathered) if cp.return_gathered else out


def _ag_rows_fwd(a, b, cp, scale=None):
  out, gathered = registry.dispatch("ag_rows", a, b, cp, True, scale)
  return ((out, gathered) if cp.return_gathered else out), (gathered, b, scale)


def _ag_rows_bwd(cp, res, ct):
  gathered, b, scale = res
  dout, dgathered = ct if cp.return_gathered else (ct, None)
  if scale is not None:
    return scaled.ag_rows_bwd(cp, gathered, b, scale, dout, dgathered)
  bT = cf.mT(b)
  da = registry.core("rs_rows").fn(dout, bT, dual_params("rs_rows", dout, bT, cp, gathered.dtype))
  if dgathered is not None:
    da = da + lax.psum_scatter(dgathered, cp.ring.axis_name, scatter_dimension=1, tiled=True)
  db = cf.local_bmm(gathered, dout, ((1,), (1,)), b.dtype, cp.ring.precision)
  return da, db, None


ag_rows.defvjp(_ag_rows_fwd, _ag_rows_bwd)

registry.register(registry.Core("ag_rows", "gathered rows", ag_rows, gathers=True, impls={
    "reference": registry.Impl(
        "reference", lambda a, b, cp, g, scale=None: _ag_rows_ring(a, b, cp.ring, scale)),
    "unfused": registry.Impl(
        "unfused", lambda a, b, cp, g, scale=None: _ag_rows_unfused(a, b, cp.ring, scale)),
    "triton": registry.Impl("triton", _ag_rows_kernel, registry.kernel_2d_unsupported),
}))


# --- ag_k: a @ all_gather(b, contracting) -----------------------------------------------------

def _ag_k_ring(a, b, p: RingParams, scale=None):
  n = p.axis_size
  k = b.shape[1]
  perm = ring.from_next(p)
  idx = lax.axis_index(p.axis_name)
  acc_dtype = ring.acc_dtype(p.out_dtype)
  spans = ring.pieces(k, p.chunks)
  parts = [lax.slice_in_dim(b, lo, lo + ln, axis=1) for lo, ln in spans]
  acc, gathered = None, []
  for step in range(n):
    nxt = [lax.ppermute(x, p.axis_name, perm) for x in parts] if step < n - 1 else None
    src = (idx + step) % n
    for (lo, ln), x in zip(spans, parts):
      a_cols = lax.dynamic_slice_in_dim(a, src * k + lo, ln, axis=2)
      part = ring.bmm(a_cols, x, p, acc_dtype if scale is None else np.float32)
      acc = part if acc is None else acc + part
    gathered.append(jnp.concatenate(parts, axis=1))
    parts = nxt
  if scale is not None:
    acc = acc * scale
  return acc.astype(p.out_dtype), ring.gather_rows(gathered, 1, p)


def _ag_k_unfused(a, b, p: RingParams, scale=None):
  g = lax.all_gather(b, p.axis_name, axis=1, tiled=True)
  return ring.bmm(a, g, p, scale=scale), g


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def ag_k(a, b, cp: CoreParams, scale=None):
  out, gathered = registry.dispatch("ag_k", a, b, cp, True, scale)
  return (out, gathered) if cp.return_gathered else out


def _ag_k_fwd(a, b, cp, scale=None):
  out, gathered = registry.dispatch("ag_k", a, b, cp, True, scale)
  return ((out, gathered) if cp.return_gathered else out), (a, gathered, scale)


def _ag_k_bwd(cp, res, ct):
  a, gathered, scale = res
  dout, dgathered = ct if cp.return_gathered else (ct, None)
  if scale is not None:
    return scaled.ag_k_bwd(cp, a, gathered, scale, dout, dgathered)
  da = cf.local_bmm(dout, gathered, ((2,), (2,)), a.dtype, cp.ring.precision)
  aT = cf.mT(a)
  db = registry.core("rs_rows").fn(aT, dout, dual_params("rs_rows", aT, dout, cp, gathered.dtype))
  if dgathered is not None:
    db = db + lax.psum_scatter(dgathered, cp.ring.axis_name, scatter_dimension=1, tiled=True)
  return da, db, None


ag_k.defvjp(_ag_k_fwd, _ag_k_bwd)

registry.register(registry.Core("ag_k", "contracting-dim gathers", ag_k, gathers=True, impls={
    "reference": registry.Impl(
        "reference", lambda a, b, cp, g, scale=None: _ag_k_ring(a, b, cp.ring, scale)),
    "unfused": registry.Impl(
        "unfused", lambda a, b, cp, g, scale=None: _ag_k_unfused(a, b, cp.ring, scale)),
}))


# --- the public op ----------------------------------------------------------------------------

def ag_matmul(x, w, axis_name, *, gather_dim: int = 0, gather_operand: int = 0,
              dimension_numbers: cf.DotDimensionNumbers | None = None,
              precision: Any = None, preferred_element_type: Any = None,
              scales=None, return_gathered: bool = False, config: OverlapConfig | None = None):
  """`dot_general(all_gather(x, axis_name, axis=gather_dim, tiled=True), w)`, fused.

  With `gather_operand=1` the gather applies to `w` instead.  `gather_dim` may
  be a free dimension of the gathered operand (rows or columns of the result
  are gathered) or a contracting dimension (FSDP weight gather; partial
  products are summed as shards arrive).  With `return_gathered=True` also
  returns the gathered operand, so that further matmuls can reuse it.

  fp8 operands (x and w both float8_e4m3fn / float8_e5m2): the gather moves fp8
  bytes, `preferred_element_type` (bfloat16 or float32) is the result's dtype and
  `scales=(scale_x, scale_w)` their per-tensor dequantization scales (real value =
  fp8 value * scale; one value each, or None for 1): the result is
  `(dot_general(gathered x, w) in f32) * scale_x * scale_w`, cast once.
  """
  op = "ag_matmul"
  axis_name = cf.single_axis(axis_name, op)
  if gather_operand not in (0, 1):
    raise ValueError(f"{op}: gather_operand={gather_operand!r} must be 0 (x) or 1 (w)")
  config = as_overlap_config(config, f"{op}: config")
  n = cf.axis_size(axis_name, op)
  x, w = jnp.asarray(x), jnp.asarray(w)
  scale = scaled.combined_scale(op, x, w, scales, preferred_element_type)
  dn = cf.default_dn(x, w) if dimension_numbers is None else dimension_numbers
  ops = [x, w]
  gathered_op, other = ops[gather_operand], ops[1 - gather_operand]
  g = cf.norm_dim(gather_dim, gathered_op.ndim, "gather_dim", op)
  full_shape = list(gathered_op.shape)
  full_shape[g] *= n
  which = "x" if gather_operand == 0 else "w"
  dims = DotDims(dn, x.ndim, w.ndim)
  (ab, ac, af), (ob, oc, of) = dims.side(gather_operand)
  if g in ab:
    raise ValueError(f"{op}: gather_dim={g} of {which} is a batch dimension of the dot_general "
                     f"{dn}; only free or contracting dimensions can be gathered")
  sds = [cf.sds(x.shape, x.dtype), cf.sds(w.shape, w.dtype)]
  sds[gather_operand] = cf.sds(full_shape, gathered_op.dtype)
  out_sds = cf.dot_out(
      op, sds[0], sds[1], dn, precision, preferred_element_type,
      f"{which} {cf.fmt(gathered_op.shape, gathered_op.dtype)} gathered on dim {g} over axis "
      f"{axis_name!r} of size {n} is {cf.fmt(full_shape, gathered_op.dtype)}; the other operand "
      f"is {cf.fmt(other.shape, other.dtype)}")
  x, w = cf.as_varying(x, w, axis_name)
  scale = scaled.varying_like(scale, x)
  gathered_op, other = (x, w) if gather_operand == 0 else (w, x)
  batch_sizes = [gathered_op.shape[d] for d in ab]
  batch_labels = [("b", i) for i in range(len(ab))]
  a_final, o_final = [("A", d) for d in af], [("O", d) for d in of]
  final = batch_labels + (a_final + o_final if gather_operand == 0 else o_final + a_final)

  if g in af:  # gathered rows (or columns) of the result
    af_ord = (g, *(d for d in af if d != g))
    a3 = cf.to_bmk(gathered_op, ab, af_ord, ac)
    b3 = cf.to_bmk(other, ob, oc, of)
    cp = op_params("ag_rows", axis_name, n, a3, b3, precision, out_sds.dtype, config,
                   return_gathered)
    res = ag_rows(a3, b3, cp, scale)
    out3, g3 = res if return_gathered else (res, None)
    a_sizes = [gathered_op.shape[d] * (n if d == g else 1) for d in af_ord]
    labels = batch_labels + [("A", d) for d in af_ord] + [("O", d) for d in of]
    sizes = batch_sizes + a_sizes + [other.shape[d] for d in of]
    g_order = (*ab, *af_ord, *ac)
  else:  # contracting-dimension gather: the gathered operand's K is sharded
    pairs = sorted(zip(ac, oc), key=lambda p: p[0] != g)
    ac_ord, oc_ord = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    a3 = cf.to_bmk(other, ob, of, oc_ord)           # [B, M, n*k]
    b3 = cf.to_bmk(gathered_op, ab, ac_ord, af)     # [B, k, N]
    cp = op_params("ag_k", axis_name, n, a3, b3, precision, out_sds.dtype, config,
                   return_gathered)
    res = ag_k(a3, b3, cp, scale)
    out3, g3 = res if return_gathered else (res, None)
    labels = batch_labels + [("O", d) for d in of] + [("A", d) for d in af]
    sizes = batch_sizes + [other.shape[d] for d in of] + [gathered_op.shape[d] for d in af]
    g_order = (*ab, *ac_ord, *af)
  out = cf.from_labelled(out3, sizes, labels, final)
  if not return_gathered:
    return out
  gathered = cf.from_labelled(g3, [full_shape[d] for d in g_order], list(g_order),
                              list(range(gathered_op.ndim)))
  return out, gathered
