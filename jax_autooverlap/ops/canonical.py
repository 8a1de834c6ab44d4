"""A fused op's call brought to the canonical form [B, M, K] x [B, K, N] and back.

The public ops take any dot_general dimension numbers; the cores take 3-D
operands (a transpose/reshape of the local shard).  Shared here: the argument
checks (errors name the op, shapes and axis), the moves to and from the
canonical form, and the helpers the VJPs use on canonical operands.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax import lax

from jax_autooverlap._compat import vary_over, varying_axes

DotDimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]
SWAP_MK = (0, 2, 1)


# --- argument checks -----------------------------------------------------------------

def single_axis(axis_name, op: str):
  if isinstance(axis_name, (tuple, list)):
    if len(axis_name) != 1:
      raise ValueError(f"{op}: axis_name={tuple(axis_name)!r} names {len(axis_name)} mesh axes; "
                       "fused ops take exactly one axis (use the unfused collectives for "
                       "multi-axis gathers/scatters)")
    axis_name = axis_name[0]
  return axis_name


def axis_size(axis_name, op: str) -> int:
  try:
    return int(lax.axis_size(axis_name))
  except NameError as e:
    raise NameError(f"{op}: unbound axis name {axis_name!r}: call it inside a shard_map "
                    f"(or jit/pmap) whose mesh has an axis named {axis_name!r} ({e})") from None


def default_dn(x, w) -> DotDimensionNumbers:
  return (((x.ndim - 1,), (0,)), ((), ()))


def norm_dim(d: int, ndim: int, what: str, op: str) -> int:
  if not isinstance(d, (int, np.integer)) or not -ndim <= d < ndim:
    raise ValueError(f"{op}: {what}={d!r} is out of range for an operand of rank {ndim}")
  return int(d) % ndim


def sds(shape, dtype):
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def fmt(shape, dtype) -> str:
  return f"{np.dtype(dtype).name}[{','.join(map(str, shape))}]"


def dot_out(op, lhs_sds, rhs_sds, dn, precision, preferred_element_type, context):
  """Shape/dtype of the unfused dot_general; re-raise JAX's own check with our context."""
  try:
    return jax.eval_shape(
        lambda l, r: lax.dot_general(l, r, dn, precision=precision,
                                     preferred_element_type=preferred_element_type),
        lhs_sds, rhs_sds)
  except (TypeError, ValueError) as e:
    raise type(e)(f"{op}: {context}: {e}") from None


def as_varying(x, w, axis_name):
  """x and w marked varying over the axis and over every axis either already varies over.

  JAX's own collectives require the first under check_vma; the second keeps
  the custom VJPs' cotangent types equal to the operands' types: an operand
  invariant over an axis its partner varies over (a weight replicated over
  'dp' times 'dp'-sharded activations) gets JAX's pcast, whose transpose sums
  its cotangent over that axis outside the fused op.
  """
  axes = {axis_name} | varying_axes(x) | varying_axes(w)
  return vary_over(x, axes), vary_over(w, axes)


# --- to and from the canonical form -----------------------------------------------------

def to_bmk(x, batch, rows, cols):
  """Transpose x to (batch, rows, cols) and merge each group: [B, M, K]."""
  order = (*batch, *rows, *cols)
  xt = x if order == tuple(range(x.ndim)) else lax.transpose(x, order)
  size = lambda dims: math.prod(x.shape[d] for d in dims)
  return xt.reshape(size(batch), size(rows), size(cols))


def from_labelled(y3, sizes, labels, final_labels):
  """Split a canonical result into labelled dims and put them in final order."""
  y = y3.reshape(sizes)
  perm = tuple(labels.index(lab) for lab in final_labels)
  return y if perm == tuple(range(len(perm))) else lax.transpose(y, perm)


# --- on canonical operands (the VJPs) ------------------------------------------------------

def mT(x):
  """[B, M, K] -> [B, K, M]."""
  return lax.transpose(x, SWAP_MK)


def local_bmm(x, y, contract, dtype, precision):
  """[B,*,*] x [B,*,*] with the given contracting dims (one each) and batch dim 0."""
  return lax.dot_general(x, y, ((contract[0], contract[1]), ((0,), (0,))),
                         precision=precision, preferred_element_type=dtype)
