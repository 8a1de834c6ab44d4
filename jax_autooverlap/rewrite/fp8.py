"""The fp8 forms of a matmul next to a collective, as JAX programs write them.

XLA turns these into one fp8 GEMM (its GEMM rewriter, gemm_rewriter.cc): a dot_general
operand that is
  - an fp8 value (float8_e4m3fn / float8_e5m2), possibly through layout ops: the direct form
    (`dot_general(q_a, q_b, preferred_element_type=bf16)`, the scales applied to the result);
  - or its dequantization `convert(q) [* s | / s]` with s a per-tensor scalar (a broadcast
    of one value), then layout ops: the quantize-dequantize form of Flax's fp8 ops
    (`qdq`: `x / s -> clip -> convert to fp8 -> convert back -> * s`) and model code.
The rewrite matches the same operands (`dequantized`), and next to a collective:
  - all_gather -> quantize -> matmul: the quantization (elementwise ops whose other operands
    are per-tensor scalars: `ElementwiseOp`) is applied to the shard, the fp8 shard gathered
    (`gather_path` finds the path from the gathered value to the matmul); the amax of the
    gathered value (`max(abs(g))`: current scaling's scale, or delayed scaling's amax
    history) becomes the max over the group of the shards' amaxes (`amax_use`);
  - dequantize -> all_gather -> matmul: the fp8 source is gathered instead;
  - matmul -> [* s] -> psum_scatter: the scales move into the kernel's epilogue, the
    partials stay in the matmul's result dtype (bf16/f32) for the sum.
Scales other than per tensor (per row, per column, per block) are not matched: the fused
ops apply one scale per operand.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax import lax

from jax_autooverlap import fp8
from jax_autooverlap._compat import vary_over, varying_axes
from jax_autooverlap.reasons import Reason
from jax_autooverlap.rewrite import _jax
from jax_autooverlap.rewrite.layout import LAYOUT_PRIMITIVES

# Shape-preserving elementwise primitives a quantization is made of; besides the value, their
# operands must be per-tensor scalars.
ELEMENTWISE = frozenset({"mul", "div", "max", "min", "clamp", "convert_element_type", "neg",
                         "round", "pvary", "pcast", "copy", "copy_p"})
# Calls of a function made of those (jnp.clip is a jit of max and min).
CALLS = frozenset({"jit", "pjit", "closed_call"})
# What a per-tensor scalar reaches an elementwise op through.
SCALAR_MOVES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "convert_element_type",
                          "pvary", "pcast", "copy", "copy_p"})
# Layout ops that commute with a dequantization (a per-tensor scale): re-applied to the fp8
# value.  Casts between wide types after the dequantization are dropped (the fused op's
# result has the matmul's dtype).
MOVES = LAYOUT_PRIMITIVES - {"convert_element_type"}


@dataclasses.dataclass(frozen=True)
class Scalar:
  """A per-tensor operand: a value of one element and the casts applied to it on its way."""
  var: Any
  casts: tuple = ()

  def read(self, read, like):
    """The scalar as a rank-0 value, marked varying like `like` (binary ops need equal types)."""
    x = lax.reshape(read(self.var), ())
    for dtype in self.casts:
      x = lax.convert_element_type(x, dtype)
    return vary_over(x, varying_axes(like))


def per_tensor(ctx, v) -> Scalar | tuple | None:
  """v as a per-tensor scalar (through broadcasts, reshapes, casts), or ("layout", shape) of
  a broadcast from a larger value (a per-row, per-column or block scale), or None."""
  casts = []
  while True:
    if math.prod(v.aval.shape) == 1:
      return Scalar(v, tuple(reversed(casts)))
    if not _jax.is_var(v) or v not in ctx.producer:
      return None
    eqn = ctx.jaxpr.eqns[ctx.producer[v]]
    name = eqn.primitive.name
    if name not in SCALAR_MOVES:
      return None
    if name == "broadcast_in_dim" and math.prod(eqn.invars[0].aval.shape) > 1:
      return ("layout", tuple(eqn.invars[0].aval.shape))
    if name == "convert_element_type":
      casts.append(eqn.params["new_dtype"])
    v = eqn.invars[0]


@dataclasses.dataclass(frozen=True)
class ElementwiseOp:
  """An equation applied to each element of one value (operand `main`), its other operands
  per-tensor scalars: it commutes with gathers and can run on a shard."""
  eqn: Any
  main: int
  scalars: tuple  # (operand index, Scalar) of the other operands

  @property
  def name(self) -> str:
    """The primitive, or the name of the function a call calls (jnp.clip's "clip")."""
    return self.eqn.params.get("name") or self.eqn.primitive.name

  def apply(self, x, read):
    ops = [None] * len(self.eqn.invars)
    ops[self.main] = x
    for j, s in self.scalars:
      ops[j] = s.read(read, x) if self.eqn.primitive.name not in CALLS else \
          lax.reshape(read(s.var), ())
    if self.eqn.primitive.name in CALLS:
      closed = self.eqn.params["jaxpr"]
      return _eval(closed.jaxpr, closed.consts, ops)
    bind = self.eqn.primitive.get_bind_params(self.eqn.params)
    if isinstance(bind, tuple):
      bind = bind[1]
    return self.eqn.primitive.bind(*ops, **bind)


def _eval(jaxpr, consts, args):
  from jax import core
  (out,) = core.eval_jaxpr(jaxpr, consts, *args)
  return out


def _call_is_elementwise(eqn) -> bool:
  body = eqn.params.get("jaxpr")
  body = getattr(body, "jaxpr", body)
  if body is None or len(eqn.outvars) != 1:
    return False
  return all((e.primitive.name in ELEMENTWISE and "shape" not in e.params)
             or (e.primitive.name in CALLS and _call_is_elementwise(e)) for e in body.eqns)


def elementwise(ctx, eqn, u) -> ElementwiseOp | None:
  """eqn as an elementwise op on value u (its operand of u's shape), or None."""
  name = eqn.primitive.name
  if len(eqn.outvars) != 1 or eqn.outvars[0].aval.shape != u.aval.shape:
    return None
  if name in CALLS:
    if not _call_is_elementwise(eqn):
      return None
  elif name not in ELEMENTWISE:
    return None
  mains = [j for j, x in enumerate(eqn.invars) if x is u]
  if len(mains) != 1:
    return None
  scalars = []
  for j, x in enumerate(eqn.invars):
    if j == mains[0]:
      continue
    s = per_tensor(ctx, x)
    if not isinstance(s, Scalar) or (name in CALLS and x.aval.shape != ()):
      return None
    scalars.append((j, s))
  return ElementwiseOp(eqn, mains[0], tuple(scalars))


@dataclasses.dataclass(frozen=True)
class Factor:
  """A per-tensor scale the product is multiplied (or divided) by."""
  scalar: Scalar
  divide: bool = False


def scale_of(factors, read, like):
  """The f32[] product of the factors (None if there are none)."""
  if not factors:
    return None
  scale = None
  for f in factors:
    s = lax.convert_element_type(f.scalar.read(read, like), np.float32)
    s = lax.div(np.float32(1), s) if f.divide else s
    scale = s if scale is None else scale * s
  return scale


def _dequant_step(ctx, eqn):
  """For `value * s`, `s * value` or `value / s`: (value, Factor) where s is per-tensor,
  (value, shape of s's source) where s is a broadcast of a larger value (per row, column or
  block); else None."""
  name = eqn.primitive.name
  if name not in ("mul", "div") or len(eqn.invars) != 2:
    return None
  found, shape = None, eqn.outvars[0].aval.shape
  for val, sc in ([(0, 1)] if name == "div" else [(0, 1), (1, 0)]):
    if eqn.invars[val].aval.shape != shape:
      continue
    s = per_tensor(ctx, eqn.invars[sc])
    if isinstance(s, Scalar):
      return eqn.invars[val], Factor(s, name == "div")
    if s is None and eqn.invars[sc].aval.shape != shape:  # broadcast by the op itself
      s = ("layout", tuple(eqn.invars[sc].aval.shape))
    if s is not None and found is None:
      found = (eqn.invars[val], s[1])
  return found


def scaling(ctx, eqn):
  """(value, Factor) if eqn is `value * s`, `s * value` or `value / s` with s per-tensor,
  (value, shape) if s is a broadcast of a larger value (per row, column or block), else None."""
  return _dequant_step(ctx, eqn)


def scale_layout_reason(shape) -> Reason:
  return Reason("fp8_scale_layout", f"an fp8 matmul's scale is a broadcast of shape {shape} (per "
                "row, column or block); the fused fp8 ops take per-tensor scales")


@dataclasses.dataclass(frozen=True)
class Dequantized:
  """A matmul operand as the dequantization of an fp8 value: operand = moves(source) * scale.

  moves: ("move", eqn) re-applied to the fp8 value in program order, or ("gather", eqn) where
  the dequantized value was gathered (the fp8 source is gathered instead)."""
  source: Any
  moves: tuple = ()
  factors: tuple = ()

  @property
  def gather(self):
    return next((e for kind, e in self.moves if kind == "gather"), None)


def dequantized(ctx, v, gathers: bool = False, stop=frozenset()) -> Dequantized | Reason | None:
  """The fp8 value a matmul operand v dequantizes (as XLA's GEMM rewriter reads operands):
  through layout ops, casts between wide types, `* s` / `/ s` with s per-tensor, one cast
  from fp8; with `gathers` also through one all_gather.  None if v is no such operand, a
  Reason if it is one with scales other than per tensor.  Never walks past values in `stop`."""
  moves, factors, layout = [], [], None
  while True:
    if fp8.is_fp8(v.aval.dtype):
      if layout is not None:
        return scale_layout_reason(layout)
      return Dequantized(v, tuple(reversed(moves)), tuple(factors))
    if v in stop or not _jax.is_var(v) or v not in ctx.producer:
      return None
    eqn = ctx.jaxpr.eqns[ctx.producer[v]]
    name = eqn.primitive.name
    if name == "convert_element_type":
      v = eqn.invars[0]
      continue
    if name in MOVES:
      moves.append(("move", eqn))
      v = eqn.invars[0]
      continue
    if name == "all_gather" and gathers and not any(k == "gather" for k, _ in moves):
      moves.append(("gather", eqn))
      v = eqn.invars[0]
      continue
    found = _dequant_step(ctx, eqn)
    if found is None:
      return None
    v, factor = found
    if isinstance(factor, Factor):
      factors.append(factor)
    else:
      layout = factor


def read_moved(d: Dequantized, read):
  """The fp8 source with its layout moves re-applied (no gather: the other operand)."""
  x = read(d.source)
  for _, eqn in d.moves:
    x = _rebind(eqn, x)
  return x


def _rebind(eqn, x):
  bind = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bind, tuple):
    bind = bind[1]
  return eqn.primitive.bind(x, **bind)


def rebind(eqn, x):
  """A layout op applied as written to another value of the same shape (an fp8 one)."""
  return _rebind(eqn, x)


@dataclasses.dataclass(frozen=True)
class Path:
  """From a gathered value to the matmul operand it becomes: steps (equation index, eqn,
  ElementwiseOp or None for a layout op), the values (the gathered one, then each step's
  result), the matmuls reading the last; scale_layout: the shape of a scale on the way that
  is not per tensor (the path went on through it), or None."""
  steps: tuple
  values: tuple
  dots: tuple
  scale_layout: tuple | None = None


def gather_path(ctx, g, limit: int = 64) -> Path:
  """Forward from g through layout and elementwise ops (each the only such use of the value
  before it; other uses are the values' side uses) to the first value matmuls read."""
  steps, values, u, layout = [], [g], g, None
  for _ in range(limit):
    dots, cont = [], []
    for i in ctx.uses[u]:
      eqn = ctx.jaxpr.eqns[i]
      name = eqn.primitive.name
      if u is g and amax_use(ctx, g, i) is not None:
        continue  # a side use
      if name == "dot_general":
        dots.append(i)
      elif name in MOVES and eqn.invars[0] is u:
        cont.append((i, None))
      else:
        op = elementwise(ctx, eqn, u)
        scaled = None if op is not None else _dequant_step(ctx, eqn)
        if op is not None:
          cont.append((i, op))
        elif scaled is not None and scaled[0] is u and not isinstance(scaled[1], Factor):
          layout = layout or scaled[1]
          cont.append((i, None))
    if dots or len(cont) != 1:
      return Path(tuple(steps), tuple(values), tuple(dots), layout)
    i, op = cont[0]
    steps.append((i, ctx.jaxpr.eqns[i], op))
    u = ctx.jaxpr.eqns[i].outvars[0]
    values.append(u)
  return Path(tuple(steps), tuple(values), (), layout)


def amax_use(ctx, g, i: int):
  """Use i of the gathered value g as `reduce_max(abs(g))` over every dim (its amax): the abs
  and reduce_max equations, or None."""
  eqn = ctx.jaxpr.eqns[i]
  if eqn.primitive.name != "abs" or eqn.invars[0] is not g:
    return None
  a = eqn.outvars[0]
  if a in ctx.outvars or len(ctx.uses[a]) != 1:
    return None
  red = ctx.jaxpr.eqns[ctx.uses[a][0]]
  if red.primitive.name != "reduce_max" or set(red.params["axes"]) != set(range(g.aval.ndim)):
    return None
  return eqn, red
