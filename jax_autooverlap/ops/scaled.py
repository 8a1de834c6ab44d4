"""fp8 operands of the fused ops: the per-tensor scales, and what the backward pass computes.

A fused op on fp8 operands (float8_e4m3fn / float8_e5m2, any pairing; both or neither)
computes `(a @ b in f32) * scale` cast to its output dtype (bf16 or f32), where `scale` is
the product of the operands' per-tensor scales (jax_autooverlap/fp8.py).  The cores take it
as one f32[] operand.

Backward: what `jax.grad` of the unfused program computes.  JAX's transpose of an fp8
dot_general multiplies the cotangent (in the output's precision) with the other fp8 operand
in f32 and casts the result to the operand's fp8 dtype.  The dual op does the same on the
dequantized operand (an fp8 -> bf16/f32 conversion is exact): the cotangent's own dtype
for the communicated operands, an f32 product, the scale applied, then the fp8 cast.  So the
dual runs the 16-bit (or f32) kernels.  Gradients *quantized* to e5m2 are a program's choice
(Flax's fp8 ops quantize them in their custom VJPs): the rewrite finds such backward matmuls
in the program and gives them the fp8 kernels (e5m2 x e4m3).  The scale's cotangent is the
f32 inner product <raw product's cotangent, operand> taken on the side that is local.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_autooverlap import fp8
from jax_autooverlap._compat import vary_over, varying_axes
from jax_autooverlap.ops import canonical as cf
from jax_autooverlap.ops import registry
from jax_autooverlap.ops.planning import dual_params

F32 = np.dtype(np.float32)


def combined_scale(op: str, x, w, scales, preferred_element_type):
  """The f32[] scale a core applies (None for 16-/32-bit operands), after checking that the
  operands are both fp8 or neither, that fp8 ones name a bf16/f32 output, and the scales."""
  fp8_x, fp8_w = fp8.is_fp8(x.dtype), fp8.is_fp8(w.dtype)
  if fp8_x != fp8_w:
    raise ValueError(f"{op}: x is {cf.fmt(x.shape, x.dtype)} and w {cf.fmt(w.shape, w.dtype)}; "
                     f"fp8 operands ({', '.join(fp8.FP8_DTYPES)}) must both be fp8")
  if not fp8_x:
    if scales is not None:
      raise ValueError(f"{op}: scales={scales!r} apply to fp8 operands; x and w are "
                       f"{np.dtype(x.dtype).name} and {np.dtype(w.dtype).name}")
    return None
  out = None if preferred_element_type is None else np.dtype(preferred_element_type).name
  if out not in fp8.FP8_OUT_DTYPES:
    raise ValueError(f"{op}: fp8 operands need preferred_element_type in "
                     f"{fp8.FP8_OUT_DTYPES} (the product's dtype), got {out}")
  if scales is None:
    scales = (None, None)
  if not isinstance(scales, (tuple, list)) or len(scales) != 2:
    raise ValueError(f"{op}: scales={scales!r} must be a pair (scale of x, scale of w), each a "
                     "per-tensor scale (one value) or None")
  scale = jnp.ones((), F32)
  for which, s in zip(("x", "w"), scales):
    if s is None:
      continue
    s = jnp.asarray(s)
    if s.size != 1 or not jnp.issubdtype(s.dtype, jnp.floating):
      raise ValueError(f"{op}: the scale of {which} is {cf.fmt(s.shape, s.dtype)}; the fused ops "
                       "take per-tensor scales (one floating-point value)")
    scale = scale * s.reshape(()).astype(F32)
  return scale


def varying_like(scale, x):
  """The scale marked varying over every axis x varies over (its cotangent then has the type
  JAX expects; JAX's own pcast transpose sums it where the scale is replicated)."""
  return None if scale is None else vary_over(scale, varying_axes(x))


def _widen(x, like):
  """fp8 x as like's dtype (exact)."""
  return x.astype(like.dtype)


def _inner(raw, x):
  """<raw, x> in f32: the scale's cotangent."""
  return jnp.sum(raw * x.astype(F32))


def ag_rows_bwd(cp, gathered, b, scale, dout, dgathered):
  """Cotangents of ag_rows(a, b, scale): da = RS(dout @ b^T) * scale, db = G(a)^T dout * scale."""
  bT = _widen(cf.mT(b), dout)
  da = registry.core("rs_rows").fn(dout, bT, dual_params("rs_rows", dout, bT, cp, F32)) * scale
  if dgathered is not None:
    da = da + lax.psum_scatter(dgathered.astype(F32), cp.ring.axis_name, scatter_dimension=1,
                               tiled=True)
  db_raw = cf.local_bmm(_widen(gathered, dout), dout, ((1,), (1,)), F32, cp.ring.precision)
  return (da.astype(gathered.dtype), (db_raw * scale).astype(b.dtype), _inner(db_raw, b))


def ag_k_bwd(cp, a, gathered, scale, dout, dgathered):
  """Cotangents of ag_k(a, b, scale): da = dout @ G(b)^T * scale, db = RS_K(a^T @ dout) * scale."""
  da_raw = cf.local_bmm(dout, _widen(gathered, dout), ((2,), (2,)), F32, cp.ring.precision)
  aT = _widen(cf.mT(a), dout)
  db = registry.core("rs_rows").fn(aT, dout, dual_params("rs_rows", aT, dout, cp, F32)) * scale
  if dgathered is not None:
    db = db + lax.psum_scatter(dgathered.astype(F32), cp.ring.axis_name, scatter_dimension=1,
                               tiled=True)
  return (da_raw * scale).astype(a.dtype), db.astype(gathered.dtype), _inner(da_raw, a)


def rs_rows_bwd(cp, a, b, scale, dout):
  """Cotangents of rs_rows(a, b, scale): da = G(dout) @ b^T * scale, db = a^T G(dout) * scale."""
  bT = _widen(cf.mT(b), dout)
  da_raw, gathered_dout = registry.core("ag_rows").fn(
      dout, bT, dual_params("ag_rows", dout, bT, cp, F32, return_gathered=True))
  db_raw = cf.local_bmm(_widen(a, dout), gathered_dout, ((1,), (1,)), F32, cp.ring.precision)
  return ((da_raw * scale).astype(a.dtype), (db_raw * scale).astype(b.dtype),
          _inner(da_raw, a))
