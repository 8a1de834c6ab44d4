"""A sum of matmuls as one matmul over concatenated contracting dims.

The VJP of one gathered value feeding several matmuls (Q/K/V, gate/up) is
  psum_scatter(dq @ wq.T + dk @ wk.T + dv @ wv.T)
and sum_i dot(a_i, b_i) == dot([a_1 .. a_k], [b_1 .. b_k]) with the operands
concatenated along their contracting dims.  So the reduce-scatter of such a
sum is one GEMM+RS of the existing fused op, with no new kernel.

The matmuls can be merged when they agree on everything but the size of their
contracting dims: the number of batch and free dims of each operand (which,
with equal result shapes, makes those dims equal), the operand dtypes,
precision and result type.  Operands with one contracting dim at the same
position in every matmul are concatenated in place; otherwise each operand is
first brought to (batch, free, contracting) / (batch, contracting, free) with
its contracting dims merged into one.
"""
from __future__ import annotations

import math

from jax import lax

from jax_autooverlap.ops.dims import DotDims


def _dims(eqn) -> DotDims:
  lhs, rhs = eqn.invars
  return DotDims(eqn.params["dimension_numbers"], lhs.aval.ndim, rhs.aval.ndim)


def merge_reason(dots) -> str | None:
  """Why these dot_general equations cannot be merged into one, or None."""
  first, d0 = dots[0], _dims(dots[0])
  for i, eqn in enumerate(dots[1:], 1):
    d = _dims(eqn)
    counts = lambda x: (len(x.lb), len(x.lf), len(x.rf))
    if counts(d) != counts(d0):
      return (f"summed matmuls 0 and {i} differ in batch/free dims {counts(d0)} vs {counts(d)} "
              "(cannot concatenate their contracting dims)")
    for side, j in (("lhs", 0), ("rhs", 1)):
      a, b = first.invars[j].aval.dtype, eqn.invars[j].aval.dtype
      if a != b:
        return f"summed matmuls 0 and {i} have {side} dtypes {a} and {b}"
    for key in ("precision", "preferred_element_type"):
      if eqn.params.get(key) != first.params.get(key):
        return f"summed matmuls 0 and {i} differ in {key}"
    if eqn.outvars[0].aval.shape != first.outvars[0].aval.shape:
      return (f"summed matmuls 0 and {i} have result shapes {first.outvars[0].aval.shape} "
              f"and {eqn.outvars[0].aval.shape}")
  return None


def _in_place(dots) -> bool:
  """Same dimension numbers and one contracting dim per operand: concatenate as they are."""
  dn = dots[0].params["dimension_numbers"]
  (lc, rc), _ = dn
  return len(lc) == 1 and all(e.params["dimension_numbers"] == dn for e in dots)


def merged_dn(dots):
  """Dimension numbers of the merged matmul."""
  if _in_place(dots):
    return dots[0].params["dimension_numbers"]
  d = _dims(dots[0])
  nb, nlf = len(d.lb), len(d.lf)
  batch = tuple(range(nb))
  return (((nb + nlf,), (nb,)), (batch, batch))


def merged_shapes(dots):
  """(lhs shape, rhs shape) of the merged matmul."""
  if _in_place(dots):
    (lc, rc), _ = dots[0].params["dimension_numbers"]
    shapes = []
    for j, c in ((0, lc[0]), (1, rc[0])):
      shape = list(dots[0].invars[j].aval.shape)
      shape[c] = sum(e.invars[j].aval.shape[c] for e in dots)
      shapes.append(tuple(shape))
    return tuple(shapes)
  d = _dims(dots[0])
  lhs, rhs = (e.aval.shape for e in dots[0].invars)
  k = sum(math.prod(e.invars[0].aval.shape[c] for c in _dims(e).lc) for e in dots)
  return (tuple(lhs[i] for i in d.lb + d.lf) + (k,),
          tuple(rhs[i] for i in d.rb) + (k,) + tuple(rhs[i] for i in d.rf))


def _canonical(x, first, middle, last, contract_last: bool):
  """x transposed to (first, middle, last) with the contracting group merged into one dim."""
  order = (*first, *middle, *last)
  xt = x if order == tuple(range(x.ndim)) else lax.transpose(x, order)
  sizes = lambda ds: [x.shape[i] for i in ds]
  contracting = last if contract_last else middle
  merged = [math.prod(sizes(contracting))]
  shape = (sizes(first) + sizes(middle) + merged) if contract_last else \
      (sizes(first) + merged + sizes(last))
  return xt.reshape(shape)


def merge(dots, operands):
  """(lhs, rhs, dimension_numbers) of one matmul equal to the sum of the dots.

  `operands` holds each dot's (lhs, rhs) values, in the order of `dots`.
  """
  if _in_place(dots):
    (lc, rc), _ = dots[0].params["dimension_numbers"]
    lhs = lax.concatenate([a for a, _ in operands], lc[0])
    rhs = lax.concatenate([b for _, b in operands], rc[0])
    return lhs, rhs, merged_dn(dots)
  lhs_parts, rhs_parts = [], []
  for eqn, (a, b) in zip(dots, operands):
    d = _dims(eqn)
    lhs_parts.append(_canonical(a, d.lb, d.lf, d.lc, contract_last=True))
    rhs_parts.append(_canonical(b, d.rb, d.rc, d.rf, contract_last=False))
  d0 = _dims(dots[0])
  nb, nlf = len(d0.lb), len(d0.lf)
  return (lax.concatenate(lhs_parts, nb + nlf), lax.concatenate(rhs_parts, nb),
          merged_dn(dots))
