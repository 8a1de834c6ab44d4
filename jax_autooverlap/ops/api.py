"""Public fused ops: `ag_matmul` and `matmul_rs`, callable inside shard_map.

They compute exactly what the unfused programs compute,
  ag_matmul:  dot_general(all_gather(x, axis, gather_dim, tiled=True), w, dn)
              (or the gather applied to w, with gather_operand=1)
  matmul_rs:  psum_scatter(dot_general(x, w, dn), axis, scatter_dim, tiled=True)
for any dot_general dimension numbers, by bringing the operands to the
canonical [B, M, K] x [B, K, N] form of `fused` (a transpose/reshape of the
local shard) and the result back.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax import lax

from jax_autooverlap._compat import varying_axes
from jax_autooverlap.ops import fused
from jax_autooverlap.ops.planning import DotDims, core_params
from jax_autooverlap.ops.reference import RingParams
from jax_autooverlap.runtime import context
from jax_autooverlap.tuning.config import OverlapConfig, resolve_chunks

DotDimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


# --- argument checking -------------------------------------------------------

def _single_axis(axis_name, op: str):
  if isinstance(axis_name, (tuple, list)):
    if len(axis_name) != 1:
      raise ValueError(f"{op}: axis_name={tuple(axis_name)!r} names {len(axis_name)} mesh axes; "
                       "fused ops take exactly one axis (use the unfused collectives for "
                       "multi-axis gathers/scatters)")
    axis_name = axis_name[0]
  return axis_name


def _axis_size(axis_name, op: str) -> int:
  try:
    return int(lax.axis_size(axis_name))
  except NameError as e:
    raise NameError(f"{op}: unbound axis name {axis_name!r}: call it inside a shard_map "
                    f"(or jit/pmap) whose mesh has an axis named {axis_name!r} ({e})") from None


def _as_varying(x, w, axis_name):
  """x and w marked varying over the axis and over every axis either already varies over.

  JAX's own collectives require the first under check_vma; the second keeps
  the custom VJPs' cotangent types equal to the operands' types: an operand
  invariant over an axis its partner varies over (a weight replicated over
  'dp' times 'dp'-sharded activations) gets JAX's pcast, whose transpose sums
  its cotangent over that axis outside the fused op.
  """
  axes = sorted({axis_name} | varying_axes(x) | varying_axes(w), key=str)
  def cast(v):
    missing = tuple(a for a in axes if a not in varying_axes(v))
    return lax.pcast(v, missing, to="varying") if missing else v  # no-op under check_vma=False
  return cast(x), cast(w)


def _default_dn(x, w) -> DotDimensionNumbers:
  return (((x.ndim - 1,), (0,)), ((), ()))


def _norm_dim(d: int, ndim: int, what: str, op: str) -> int:
  if not isinstance(d, (int, np.integer)) or not -ndim <= d < ndim:
    raise ValueError(f"{op}: {what}={d!r} is out of range for an operand of rank {ndim}")
  return int(d) % ndim


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _fmt(shape, dtype) -> str:
  return f"{np.dtype(dtype).name}[{','.join(map(str, shape))}]"


def _dot_out(op, lhs_sds, rhs_sds, dn, precision, preferred_element_type, context):
  """Shape/dtype of the unfused dot_general; re-raise JAX's own check with our context."""
  try:
    return jax.eval_shape(
        lambda l, r: lax.dot_general(l, r, dn, precision=precision,
                                     preferred_element_type=preferred_element_type),
        lhs_sds, rhs_sds)
  except (TypeError, ValueError) as e:
    raise type(e)(f"{op}: {context}: {e}") from None


# --- canonical form ------------------------------------------------------------

def _to_bmk(x, batch, rows, cols):
  """Transpose x to (batch, rows, cols) and merge each group: [B, M, K]."""
  order = (*batch, *rows, *cols)
  xt = x if order == tuple(range(x.ndim)) else lax.transpose(x, order)
  size = lambda dims: math.prod(x.shape[d] for d in dims)
  return xt.reshape(size(batch), size(rows), size(cols))


def _from_labelled(y3, sizes, labels, final_labels):
  """Split a canonical result into labelled dims and put them in final order."""
  y = y3.reshape(sizes)
  perm = tuple(labels.index(lab) for lab in final_labels)
  return y if perm == tuple(range(len(perm))) else lax.transpose(y, perm)


def _config(config: OverlapConfig | None) -> OverlapConfig:
  if config is None:
    return OverlapConfig()
  if not isinstance(config, OverlapConfig):
    raise TypeError(f"config must be an OverlapConfig, got {type(config).__name__}")
  return config


def _core_params(op, axis_name, n, a3, b3, precision, out_dtype, config, return_gathered=False):
  rows = {"ag_rows": a3.shape[1], "ag_k": b3.shape[1], "rs_rows": a3.shape[1] // n}[op]
  ring = RingParams(axis_name=axis_name, axis_size=n, chunks=resolve_chunks(config, rows),
                    precision=precision, out_dtype=np.dtype(out_dtype))
  return core_params(op, ring, a3, b3, config, context.current_mesh(), return_gathered)


# --- ag_matmul -------------------------------------------------------------------

def ag_matmul(x, w, axis_name, *, gather_dim: int = 0, gather_operand: int = 0,
              dimension_numbers: DotDimensionNumbers | None = None,
              precision: Any = None, preferred_element_type: Any = None,
              return_gathered: bool = False, config: OverlapConfig | None = None):
  """`dot_general(all_gather(x, axis_name, axis=gather_dim, tiled=True), w)`, fused.

  With `gather_operand=1` the gather applies to `w` instead.  `gather_dim` may
  be a free dimension of the gathered operand (rows or columns of the result
  are gathered) or a contracting dimension (FSDP weight gather; partial
  products are summed as shards arrive).  With `return_gathered=True` also
  returns the gathered operand, so that further matmuls can reuse it.
  """
  op = "ag_matmul"
  axis_name = _single_axis(axis_name, op)
  if gather_operand not in (0, 1):
    raise ValueError(f"{op}: gather_operand={gather_operand!r} must be 0 (x) or 1 (w)")
  config = _config(config)
  n = _axis_size(axis_name, op)
  x, w = jax.numpy.asarray(x), jax.numpy.asarray(w)
  dn = _default_dn(x, w) if dimension_numbers is None else dimension_numbers
  ops = [x, w]
  gathered_op, other = ops[gather_operand], ops[1 - gather_operand]
  g = _norm_dim(gather_dim, gathered_op.ndim, "gather_dim", op)
  full_shape = list(gathered_op.shape)
  full_shape[g] *= n
  which = "x" if gather_operand == 0 else "w"
  dims = DotDims(dn, x.ndim, w.ndim)
  (ab, ac, af), (ob, oc, of) = dims.side(gather_operand)
  if g in ab:
    raise ValueError(f"{op}: gather_dim={g} of {which} is a batch dimension of the dot_general "
                     f"{dn}; only free or contracting dimensions can be gathered")
  sds = [_sds(x.shape, x.dtype), _sds(w.shape, w.dtype)]
  sds[gather_operand] = _sds(full_shape, gathered_op.dtype)
  out_sds = _dot_out(
      op, sds[0], sds[1], dn, precision, preferred_element_type,
      f"{which} {_fmt(gathered_op.shape, gathered_op.dtype)} gathered on dim {g} over axis "
      f"{axis_name!r} of size {n} is {_fmt(full_shape, gathered_op.dtype)}; the other operand "
      f"is {_fmt(other.shape, other.dtype)}")
  x, w = _as_varying(x, w, axis_name)
  gathered_op, other = (x, w) if gather_operand == 0 else (w, x)
  batch_sizes = [gathered_op.shape[d] for d in ab]
  batch_labels = [("b", i) for i in range(len(ab))]

  if g in af:  # gathered rows (or columns) of the result
    af_ord = (g, *(d for d in af if d != g))
    a3 = _to_bmk(gathered_op, ab, af_ord, ac)
    b3 = _to_bmk(other, ob, oc, of)
    cp = _core_params("ag_rows", axis_name, n, a3, b3, precision, out_sds.dtype, config,
                      return_gathered)
    res = fused.ag_rows(a3, b3, cp)
    out3, g3 = res if return_gathered else (res, None)
    a_sizes = [gathered_op.shape[d] * (n if d == g else 1) for d in af_ord]
    labels = batch_labels + [("A", d) for d in af_ord] + [("O", d) for d in of]
    sizes = batch_sizes + a_sizes + [other.shape[d] for d in of]
    a_final, o_final = [("A", d) for d in af], [("O", d) for d in of]
    final = batch_labels + (a_final + o_final if gather_operand == 0 else o_final + a_final)
    out = _from_labelled(out3, sizes, labels, final)
    if not return_gathered:
      return out
    g_order = (*ab, *af_ord, *ac)
    gathered = _from_labelled(g3, [full_shape[d] for d in g_order], list(g_order),
                              list(range(gathered_op.ndim)))
    return out, gathered

  # Contracting-dimension gather: the gathered operand's K is sharded.
  pairs = sorted(zip(ac, oc), key=lambda p: p[0] != g)
  ac_ord, oc_ord = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
  a3 = _to_bmk(other, ob, of, oc_ord)           # [B, M, n*k]
  b3 = _to_bmk(gathered_op, ab, ac_ord, af)     # [B, k, N]
  cp = _core_params("ag_k", axis_name, n, a3, b3, precision, out_sds.dtype, config,
                    return_gathered)
  res = fused.ag_k(a3, b3, cp)
  out3, g3 = res if return_gathered else (res, None)
  labels = batch_labels + [("O", d) for d in of] + [("A", d) for d in af]
  sizes = batch_sizes + [other.shape[d] for d in of] + [gathered_op.shape[d] for d in af]
  a_final, o_final = [("A", d) for d in af], [("O", d) for d in of]
  final = batch_labels + (a_final + o_final if gather_operand == 0 else o_final + a_final)
  out = _from_labelled(out3, sizes, labels, final)
  if not return_gathered:
    return out
  g_order = (*ab, *ac_ord, *af)
  gathered = _from_labelled(g3, [full_shape[d] for d in g_order], list(g_order),
                            list(range(gathered_op.ndim)))
  return out, gathered


# --- matmul_rs -------------------------------------------------------------------

def matmul_rs(x, w, axis_name, *, scatter_dim: int = 0,
              dimension_numbers: DotDimensionNumbers | None = None,
              precision: Any = None, preferred_element_type: Any = None,
              config: OverlapConfig | None = None):
  """`psum_scatter(dot_general(x, w), axis_name, scatter_dimension=scatter_dim, tiled=True)`, fused.

  `scatter_dim` is a dimension of the product; it must be a free (row or
  column) dimension whose size is divisible by the axis size.
  """
  op = "matmul_rs"
  axis_name = _single_axis(axis_name, op)
  config = _config(config)
  n = _axis_size(axis_name, op)
  x, w = jax.numpy.asarray(x), jax.numpy.asarray(w)
  dn = _default_dn(x, w) if dimension_numbers is None else dimension_numbers
  out_sds = _dot_out(op, _sds(x.shape, x.dtype), _sds(w.shape, w.dtype), dn, precision,
                     preferred_element_type,
                     f"x {_fmt(x.shape, x.dtype)}, w {_fmt(w.shape, w.dtype)}")
  s = _norm_dim(scatter_dim, len(out_sds.shape), "scatter_dim", op)
  if out_sds.shape[s] % n:
    raise ValueError(f"{op}: scatter_dim={s} of the product {_fmt(out_sds.shape, out_sds.dtype)} "
                     f"has size {out_sds.shape[s]}, not divisible by the size {n} of axis "
                     f"{axis_name!r}")
  dims = DotDims(dn, x.ndim, w.ndim)
  nb = len(dims.lb)
  if s < nb:
    raise ValueError(f"{op}: scatter_dim={s} is a batch dimension of the dot_general {dn}; "
                     "only free (row or column) dimensions can be scattered")
  operand, g = (0, dims.lf[s - nb]) if s < nb + len(dims.lf) else (1, dims.rf[s - nb - len(dims.lf)])
  x, w = _as_varying(x, w, axis_name)
  scattered_op, other = (x, w) if operand == 0 else (w, x)
  (ab, ac, af), (ob, oc, of) = dims.side(operand)
  af_ord = (g, *(d for d in af if d != g))
  a3 = _to_bmk(scattered_op, ab, af_ord, ac)
  b3 = _to_bmk(other, ob, oc, of)
  cp = _core_params("rs_rows", axis_name, n, a3, b3, precision, out_sds.dtype, config)
  out3 = fused.rs_rows(a3, b3, cp)
  batch_labels = [("b", i) for i in range(len(ab))]
  labels = batch_labels + [("A", d) for d in af_ord] + [("O", d) for d in of]
  sizes = ([scattered_op.shape[d] for d in ab]
           + [scattered_op.shape[d] // (n if d == g else 1) for d in af_ord]
           + [other.shape[d] for d in of])
  a_final, o_final = [("A", d) for d in af], [("O", d) for d in of]
  final = batch_labels + (a_final + o_final if operand == 0 else o_final + a_final)
  return _from_labelled(out3, sizes, labels, final)
