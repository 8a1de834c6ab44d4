"""`matmul_rs`: dot_general -> psum_scatter as one fused op, everything it runs in one place.

    matmul_rs(x, w, axis, scatter_dim=s) == psum_scatter(dot_general(x, w), axis, s, tiled=True)

for any dot_general dimension numbers, by bringing the operands to the
canonical [B, M, K] x [B, K, N] form (ops/canonical.py).  One canonical core:
  rs_rows: a[B, M, K], b[B, K, N] -> out[B, M/n, N] (rows scattered, summed)
Implementations (ops/registry.py): the reference ring (any platform), the
unfused program and the GPU kernel (backends/triton.py).  The VJP uses the
dual op (ops/ag_matmul.py's ag_rows):  d/da RS(a @ b) = AG(dout) @ b^T.

fp8 operands with per-tensor scales: each GPU's partial product is scaled in
f32 and summed in the output dtype (bf16 or f32); ops/scaled.py says what the
backward computes.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_autooverlap.backends import triton as triton_backend
from jax_autooverlap.ops import canonical as cf
from jax_autooverlap.ops import registry, ring, scaled
from jax_autooverlap.ops.dims import DotDims
from jax_autooverlap.ops.planning import CoreParams, dual_params, op_params
from jax_autooverlap.ops.ring import RingParams
from jax_autooverlap.tuning.config import OverlapConfig, as_overlap_config


def _rs_rows_ring(a, b, p: RingParams, scale=None):
  n = p.axis_size
  m = a.shape[1] // n
  # The accumulator of block d starts on device d+1, moves right each step and
  # ends on device d after visiting every device once.
  perm = [(j, (j + 1) % n) for j in range(n)]
  idx = lax.axis_index(p.axis_name)
  acc_dtype = ring.acc_dtype(p.out_dtype)
  spans = ring.pieces(m, p.chunks)
  accs = [None] * len(spans)
  for step in range(n):
    dst = (idx + 2 * n - 1 - step) % n
    for c, (lo, ln) in enumerate(spans):
      rows = lax.dynamic_slice_in_dim(a, dst * m + lo, ln, axis=1)
      part = ring.bmm(rows, b, p, acc_dtype, scale)
      accs[c] = part if accs[c] is None else lax.ppermute(accs[c], p.axis_name, perm) + part
  return jnp.concatenate(accs, axis=1).astype(p.out_dtype)


def _rs_rows_unfused(a, b, p: RingParams, scale=None):
  return lax.psum_scatter(ring.bmm(a, b, p, scale=scale), p.axis_name, scatter_dimension=1,
                          tiled=True)


def _rs_rows_kernel(a, b, cp: CoreParams, need_gathered: bool, scale=None):
  return triton_backend.gemm_rs(
      a[0], b[0], axis_name=cp.ring.axis_name, mesh=cp.gpu.mesh, kernel=cp.gpu.kernel,
      out_dtype=cp.ring.out_dtype, timeout_s=cp.gpu.timeout_s, scale=scale)[None]


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rs_rows(a, b, cp: CoreParams, scale=None):
  return registry.dispatch("rs_rows", a, b, cp, True, scale)


def _rs_rows_fwd(a, b, cp, scale=None):
  return rs_rows(a, b, cp, scale), (a, b, scale)


def _rs_rows_bwd(cp, res, dout):
  a, b, scale = res
  if scale is not None:
    return scaled.rs_rows_bwd(cp, a, b, scale, dout)
  bT = cf.mT(b)
  da, gathered_dout = registry.core("ag_rows").fn(
      dout, bT, dual_params("ag_rows", dout, bT, cp, a.dtype, return_gathered=True))
  db = cf.local_bmm(a, gathered_dout, ((1,), (1,)), b.dtype, cp.ring.precision)
  return da, db, None


rs_rows.defvjp(_rs_rows_fwd, _rs_rows_bwd)

registry.register(registry.Core("rs_rows", "scattered rows", rs_rows, gathers=False, impls={
    "reference": registry.Impl(
        "reference", lambda a, b, cp, g, scale=None: _rs_rows_ring(a, b, cp.ring, scale)),
    "unfused": registry.Impl(
        "unfused", lambda a, b, cp, g, scale=None: _rs_rows_unfused(a, b, cp.ring, scale)),
    "triton": registry.Impl("triton", _rs_rows_kernel, registry.kernel_2d_unsupported),
}))


def matmul_rs(x, w, axis_name, *, scatter_dim: int = 0,
              dimension_numbers: cf.DotDimensionNumbers | None = None,
              precision: Any = None, preferred_element_type: Any = None, scales=None,
              config: OverlapConfig | None = None):
  """`psum_scatter(dot_general(x, w), axis_name, scatter_dimension=scatter_dim, tiled=True)`, fused.

  `scatter_dim` is a dimension of the product; it must be a free (row or
  column) dimension whose size is divisible by the axis size.

  fp8 operands (x and w both float8_e4m3fn / float8_e5m2): `preferred_element_type`
  (bfloat16 or float32) is the dtype partial products are summed in and the result's,
  `scales=(scale_x, scale_w)` this GPU's per-tensor scales: each GPU's partial is
  `(dot_general(x, w) in f32) * scale_x * scale_w` before the sum.
  """
  op = "matmul_rs"
  axis_name = cf.single_axis(axis_name, op)
  config = as_overlap_config(config, f"{op}: config")
  n = cf.axis_size(axis_name, op)
  x, w = jnp.asarray(x), jnp.asarray(w)
  scale = scaled.combined_scale(op, x, w, scales, preferred_element_type)
  dn = cf.default_dn(x, w) if dimension_numbers is None else dimension_numbers
  out_sds = cf.dot_out(op, cf.sds(x.shape, x.dtype), cf.sds(w.shape, w.dtype), dn, precision,
                       preferred_element_type,
                       f"x {cf.fmt(x.shape, x.dtype)}, w {cf.fmt(w.shape, w.dtype)}")
  s = cf.norm_dim(scatter_dim, len(out_sds.shape), "scatter_dim", op)
  if out_sds.shape[s] % n:
    raise ValueError(f"{op}: scatter_dim={s} of the product {cf.fmt(out_sds.shape, out_sds.dtype)} "
                     f"has size {out_sds.shape[s]}, not divisible by the size {n} of axis "
                     f"{axis_name!r}")
  dims = DotDims(dn, x.ndim, w.ndim)
  nb = len(dims.lb)
  if s < nb:
    raise ValueError(f"{op}: scatter_dim={s} is a batch dimension of the dot_general {dn}; "
                     "only free (row or column) dimensions can be scattered")
  operand, g = (0, dims.lf[s - nb]) if s < nb + len(dims.lf) else (1, dims.rf[s - nb - len(dims.lf)])
  x, w = cf.as_varying(x, w, axis_name)
  scale = scaled.varying_like(scale, x)
  scattered_op, other = (x, w) if operand == 0 else (w, x)
  (ab, ac, af), (ob, oc, of) = dims.side(operand)
  af_ord = (g, *(d for d in af if d != g))
  a3 = cf.to_bmk(scattered_op, ab, af_ord, ac)
  b3 = cf.to_bmk(other, ob, oc, of)
  cp = op_params("rs_rows", axis_name, n, a3, b3, precision, out_sds.dtype, config)
  out3 = rs_rows(a3, b3, cp, scale)
  batch_labels = [("b", i) for i in range(len(ab))]
  labels = batch_labels + [("A", d) for d in af_ord] + [("O", d) for d in of]
  sizes = ([scattered_op.shape[d] for d in ab]
           + [scattered_op.shape[d] // (n if d == g else 1) for d in af_ord]
           + [other.shape[d] for d in of])
  a_final, o_final = [("A", d) for d in af], [("O", d) for d in of]
  final = batch_labels + (a_final + o_final if operand == 0 else o_final + a_final)
  return cf.from_labelled(out3, sizes, labels, final)
