"""What the interpreter runs for the fused ops of a program without shard_map.

Each fused op runs inside a `jax.shard_map` manual over the mesh axes named
in the sharding types, with in/out specs read from them: in the body every
value is a local block, the op communicates over its axis, and matmuls that
also sum over other axes (data-parallel weight gradients) `psum` over those.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax import lax

from jax_autooverlap.ops import ag_matmul, matmul_rs
from jax_autooverlap.rewrite import _jax, fp8
from jax_autooverlap.rewrite.explicit.sharding import local_shape, pspec, spec_of
from jax_autooverlap.rewrite.match import Match
from jax_autooverlap.rewrite.plan import ExplicitAction
from jax_autooverlap.runtime import context

def _local_layout(eqn, x, shape):
  """A layout op applied to a local block whose shape after the op is `shape`."""
  name = eqn.primitive.name
  if name == "convert_element_type":
    return lax.convert_element_type(x, eqn.params["new_dtype"])
  if name == "transpose":
    return lax.transpose(x, tuple(eqn.params["permutation"]))
  if name in ("reshape", "squeeze"):
    return lax.reshape(x, shape)
  return x  # copy: values unchanged


def _scale(views, read, like):
  """The f32[] scale of an fp8 matmul's two operands (1 where they have none)."""
  scale = fp8.scale_of((*views[0].factors, *views[1].factors), read, like)
  return np.ones((), np.float32) if scale is None else scale


def _shard_map(body, mesh, cmesh, in_specs, out_specs, args):
  axes = {a for spec in (*in_specs, *out_specs) for e in spec for a in e}
  # check_vma=False: a result replicated over an axis its body varies on (a
  # gathered matmul with a replicated weight) is legal; shard_map's transpose
  # then sums cotangents over the axes an input is replicated on, as the
  # unfused program does.
  f = jax.shard_map(body, mesh=mesh, in_specs=tuple(map(pspec, in_specs)),
                    out_specs=tuple(map(pspec, out_specs)), axis_names=axes, check_vma=False)
  with context.use_mesh(cmesh):
    return f(*args)


@dataclasses.dataclass(eq=False)
class AgFusion(ExplicitAction):
  """all_gather(shard) -> [layout ops] -> dot_general, as one ag_matmul."""
  match: Match
  shard_var: Any
  shard_spec: tuple
  chain: tuple  # ((eqn, out_dim), ...) applied to the shard
  gather_dim: int
  dot_eqn: Any
  operand: int
  specs: tuple  # (other operand, result, gathered value)
  summed: tuple  # other axes the product is all-reduced over
  gathered_key: Any  # env key for the gathered value (None: not needed)
  mesh: Any
  cmesh: Any
  fp8: tuple | None = None  # fp8 matmul: fp8.Dequantized of the gathered operand (its value
                            # shard_var's) and of the other; their sources run the fused op

  @property
  def matches(self):
    return (self.match,)

  def reads(self):
    if self.fp8:
      return (self.fp8[0].source, self.fp8[1].source)
    return (self.shard_var, self.dot_eqn.invars[1 - self.operand])

  def writes(self):  # the gathered value under its own key is no program variable
    return (self.dot_eqn.outvars[0],) + ((self.gathered_key,) if _jax.is_var(self.gathered_key)
                                         else ())

  def emit(self, interp, read, env):
    a, n, x = self.match.axis_name, self.match.axis_size, self.operand
    p = self.dot_eqn.params
    need = self.gathered_key is not None

    def body(shard, other, *scale):
      for ceqn, out_dim in self.chain:
        if self.fp8 and ceqn.primitive.name == "convert_element_type":
          continue  # the fp8 source is gathered; the product has the matmul's dtype
        spec = spec_of(ceqn.outvars[0])
        shard = _local_layout(ceqn, shard, local_shape(ceqn.outvars[0], spec, self.mesh,
                                                        (out_dim, n)))
      lhs, rhs = (shard, other) if x == 0 else (other, shard)
      fp8_args = {}
      if self.fp8:
        fp8_args = dict(scales=(scale[0], None),
                        preferred_element_type=self.dot_eqn.outvars[0].aval.dtype)
      res = ag_matmul(lhs, rhs, a, gather_dim=self.gather_dim, gather_operand=x,
                      dimension_numbers=p["dimension_numbers"], precision=p["precision"],
                      **({"preferred_element_type": p["preferred_element_type"]} | fp8_args),
                      return_gathered=need, config=interp.config)
      out, gathered = res if need else (res, None)
      if self.summed:
        out = lax.psum(out, self.summed)
      return (out, gathered) if need else (out,)

    other_spec, out_spec, gathered_spec = self.specs
    args = (read(self.shard_var), read(self.dot_eqn.invars[1 - x]))
    in_specs = (self.shard_spec, other_spec)
    if self.fp8:
      args = tuple(fp8.read_moved(view, read) for view in self.fp8)
      args += (_scale(self.fp8, read, args[0]),)
      in_specs += ((),)
    outs = _shard_map(body, self.mesh, self.cmesh, in_specs,
                      (out_spec, gathered_spec) if need else (out_spec,), args)
    env[self.dot_eqn.outvars[0]] = outs[0]
    if need:
      env[self.gathered_key] = outs[1]


def producers_first(fusions):
  """Order fused ops placed at one equation so that each runs after those it reads from."""
  pending, ordered = list(fusions), []
  while pending:
    f = next(f for f in pending
             if not any(g is not f and g.gathered_key in f.reads() for g in pending))
    pending.remove(f)
    ordered.append(f)
  return ordered


@dataclasses.dataclass(eq=False)
class GatheredDot(ExplicitAction):
  """A dot_general reading the gathered value another matmul's fused op produced."""
  match: Match  # that fused op's
  dot_eqn: Any
  operand: int
  gathered_key: Any

  @property
  def matches(self):
    return (self.match,)

  def writes(self):
    return (self.dot_eqn.outvars[0],)

  def emit(self, interp, read, env):
    args = [read(v) for v in self.dot_eqn.invars]
    args[self.operand] = env[self.gathered_key]
    env[self.dot_eqn.outvars[0]] = self.dot_eqn.primitive.bind(*args, **self.dot_eqn.params)


@dataclasses.dataclass(eq=False)
class Bind(ExplicitAction):
  """The equation itself, bound as written."""
  eqn: Any

  def writes(self):
    return tuple(self.eqn.outvars)

  def emit(self, interp, read, env):
    outs = self.eqn.primitive.bind(*(read(v) for v in self.eqn.invars), **self.eqn.params)
    outs = outs if self.eqn.primitive.multiple_results else [outs]
    env.update(zip(self.eqn.outvars, outs))


@dataclasses.dataclass(eq=False)
class Then(ExplicitAction):
  """Several actions at one equation: fused ops placed ahead of a matmul that reads their
  gathered value, then the equation's own action."""
  actions: tuple

  def parts(self):
    return tuple(p for action in self.actions for p in action.parts())


@dataclasses.dataclass(eq=False)
class RsFusion(ExplicitAction):
  """dot_general (or a sum of them) -> [layout ops] -> reduce-scatter, as one matmul_rs."""
  match: Match
  dots: tuple
  concat: tuple  # (lhs dim, rhs dim) the summed matmuls' operands are concatenated along
  scatter_dim: int
  chain: tuple  # ((eqn, out_dim), ...) applied to the scattered product
  in_specs: tuple
  out_var: Any
  out_spec: tuple
  summed: tuple
  mesh: Any
  cmesh: Any
  fp8: tuple | None = None  # one fp8 matmul: fp8.Dequantized of its operands

  @property
  def matches(self):
    return (self.match,)

  def writes(self):
    return (self.out_var,)

  def emit(self, interp, read, env):
    a, n, k = self.match.axis_name, self.match.axis_size, len(self.dots)
    p = self.dots[0].params
    fp8_args = {}
    if self.fp8:
      fp8_args = dict(preferred_element_type=self.dots[0].outvars[0].aval.dtype)

    def body(*ops):
      if self.fp8:
        ops, fp8_args["scales"] = ops[:2], (ops[2], None)
      lhs, rhs = ops[:k], ops[k:]
      x = lhs[0] if k == 1 else lax.concatenate(lhs, self.concat[0])
      w = rhs[0] if k == 1 else lax.concatenate(rhs, self.concat[1])
      y = matmul_rs(x, w, a, scatter_dim=self.scatter_dim,
                    dimension_numbers=p["dimension_numbers"], precision=p["precision"],
                    **({"preferred_element_type": p["preferred_element_type"]} | fp8_args),
                    config=interp.config)
      if self.summed:
        y = lax.psum(y, self.summed)
      for ceqn, out_dim in self.chain:
        spec = spec_of(ceqn.outvars[0])
        y = _local_layout(ceqn, y, local_shape(ceqn.outvars[0], spec, self.mesh, (out_dim, n)))
      return (y,)

    args = [read(d.invars[0]) for d in self.dots] + [read(d.invars[1]) for d in self.dots]
    in_specs = self.in_specs
    if self.fp8:
      args = [fp8.read_moved(view, read) for view in self.fp8]
      args.append(_scale(self.fp8, read, args[0]))
      in_specs += ((),)
    env[self.out_var] = _shard_map(body, self.mesh, self.cmesh, in_specs,
                                   (self.out_spec,), args)[0]
