"""Find fusable collective/matmul pairs in a traced program and plan the rewrite.

Walks a closed jaxpr, recursing into every sub-jaxpr found in equation params
(jit, shard_map, scan, while, cond, remat, custom_jvp/vjp, and any other
higher-order primitive).  Inside shard_map bodies it matches
  all_gather -> [layout ops] -> dot_general     (kind "ag_matmul")
  dot_general -> [layout ops] -> reduce_scatter (kind "matmul_rs")
Outside shard_map, explicit.py matches the collectives that explicit-sharding
types imply.  Every candidate becomes a `Match`, fused or skipped with a reason.  The plan
says, per (jaxpr, equation index), what the interpreter does instead of
binding the equation: skip it, emit a fused op, or rebuild a sub-jaxpr.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import numpy as np

from jax_autooverlap.ops.planning import DotDims, describe
from jax_autooverlap.rewrite import _jax
from jax_autooverlap.rewrite.layout import LAYOUT_PRIMITIVES, dim_through
from jax_autooverlap.rewrite.match import Match, Report
from jax_autooverlap.tuning.config import OverlapConfig

FUSABLE_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class AgPlan:
  match: Match
  gather_eqn: Any
  chain: tuple  # ((eqn, out_dim), ...) applied to the shard before the fused op
  gather_dim: int  # dim of the dot operand (after the chain) that is gathered
  dot_eqn: Any
  operand: int
  result_var: Any  # the chain's end: the gathered value the dots consume
  need_gathered: bool


@dataclasses.dataclass(frozen=True)
class RsPlan:
  match: Match
  dot_eqn: Any
  scatter_dim: int  # dim of the dot output that is scattered
  chain: tuple  # ((eqn, out_dim), ...) applied to the scattered result
  rs_eqn: Any


SKIP = "skip"


@dataclasses.dataclass
class Plan:
  actions: dict = dataclasses.field(default_factory=dict)  # (id(jaxpr), i) -> SKIP | AgPlan | RsPlan
  rebuild: set = dataclasses.field(default_factory=set)    # (id(jaxpr), i) of eqns to re-trace
  report: Report = dataclasses.field(default_factory=Report)

  @property
  def has_fused(self) -> bool:
    return any(m.status == "fused" for m in self.report.matches)


def analyze(closed_jaxpr, config: OverlapConfig | None = None) -> Plan:
  plan = Plan()
  _Analyzer(plan, config or OverlapConfig()).walk(closed_jaxpr.jaxpr, False, "", None)
  if not plan.report.matches:  # say what was looked at and what to change
    from jax_autooverlap.rewrite import explicit
    plan.report.notes.extend(explicit.survey(closed_jaxpr))
  return plan


def _concrete(mesh):
  try:  # a concrete Mesh knows its devices; an AbstractMesh does not
    np.asarray(mesh.devices)
    return mesh
  except Exception:
    return None


def _impl_note(ctx, kind, deqn, operand, dim, axis_size, axis_name):
  """What will run for a fused match: the same decision the op makes."""
  lhs, rhs = deqn.invars
  dtype = lhs.aval.dtype if lhs.aval.dtype == rhs.aval.dtype else None
  n = axis_size or 1
  return describe(kind, lhs.aval.shape, rhs.aval.shape, operand, dim,
                  deqn.params["dimension_numbers"], n, dtype, deqn.outvars[0].aval.dtype,
                  ctx.config, ctx.mesh, axis_name)


class _Analyzer:

  def __init__(self, plan: Plan, config: OverlapConfig):
    self.plan = plan
    self.config = config

  # -- traversal ---------------------------------------------------------------

  def walk(self, jaxpr, manual: bool, path: str, mesh) -> bool:
    """Analyse one jaxpr; True if it (or anything inside) gets a fused op."""
    changed = False
    for i, eqn in enumerate(jaxpr.eqns):
      name = eqn.primitive.name
      sub_manual = manual or name == "shard_map"
      sub_mesh = _concrete(eqn.params.get("mesh")) if name == "shard_map" else mesh
      sub_path = f"{path}/{name}" + (f"({eqn.params['name']})" if "name" in eqn.params else "")
      for sub in _jax.sub_jaxprs(eqn.params):
        if self.walk(sub, sub_manual, sub_path, sub_mesh):
          self.plan.rebuild.add((id(jaxpr), i))
          changed = True
    if manual:
      changed |= self._match(jaxpr, path or "/", mesh)
    else:  # no shard_map: collectives implied by explicit-sharding types
      from jax_autooverlap.rewrite import explicit  # explicit.py builds on this module
      changed |= explicit.match(self.plan, self.config, jaxpr, path or "/")
    return changed

  def _match(self, jaxpr, path, mesh) -> bool:
    uses = defaultdict(list)
    producer = {}
    for i, eqn in enumerate(jaxpr.eqns):
      for v in eqn.invars:
        if _jax.is_var(v):
          uses[v].append(i)
      for v in eqn.outvars:
        producer[v] = i
    outvars = {v for v in jaxpr.outvars if _jax.is_var(v)}
    ctx = _Ctx(jaxpr, uses, producer, outvars, path, mesh, self.config)
    claimed = set()
    changed = False
    for i, eqn in enumerate(jaxpr.eqns):
      if eqn.primitive.name == "all_gather":
        changed |= self._match_ag(ctx, i, eqn, claimed)
    for i, eqn in enumerate(jaxpr.eqns):
      if eqn.primitive.name == "reduce_scatter":
        changed |= self._match_rs(ctx, i, eqn, claimed)
    return changed

  def _record(self, match: Match):
    self.plan.report.matches.append(match)

  # -- all_gather -> dot_general ---------------------------------------------------

  def _match_ag(self, ctx, gi, geqn, claimed) -> bool:
    p = geqn.params
    axes = tuple(p["axis_name"]) if isinstance(p["axis_name"], (tuple, list)) else (p["axis_name"],)
    d = int(p["all_gather_dimension"])
    n = int(p.get("axis_size") or 0) or None
    # Follow single-use layout ops from the gathered value.
    v, chain, dim, broken = geqn.outvars[0], [], d, None
    while len(ctx.uses[v]) == 1 and v not in ctx.outvars:
      nxt = ctx.jaxpr.eqns[ctx.uses[v][0]]
      if nxt.primitive.name not in LAYOUT_PRIMITIVES:
        break
      new_dim = dim_through(nxt, dim, n or 1, forward=True) if broken is None else None
      if new_dim is None and broken is None:
        broken = f"layout op {nxt.primitive.name} between gather and matmul splits the gathered dim"
      chain.append((nxt, new_dim))
      dim = new_dim
      v = nxt.outvars[0]
    dots = [i for i in ctx.uses[v] if ctx.jaxpr.eqns[i].primitive.name == "dot_general"]
    if not dots:
      return False  # not next to a matmul: not a candidate
    di = dots[0]
    deqn = ctx.jaxpr.eqns[di]
    base = dict(kind="ag_matmul", axis_name=axes[0] if len(axes) == 1 else axes, axis_size=n,
                collective_dim=d, lhs_shape=_shape(deqn.invars[0]),
                rhs_shape=_shape(deqn.invars[1]), out_shape=_shape(deqn.outvars[0]),
                dtype=str(deqn.outvars[0].aval.dtype), n_dots=len(dots),
                source=_jax.source_line(geqn), path=ctx.path)
    operand = 0 if deqn.invars[0] is v else 1
    if operand == 0 and deqn.invars[1] is v:
      operand = None
    dim_kind = None
    if operand is not None and dim is not None:
      (lc, rc), (lb, rb) = deqn.params["dimension_numbers"]
      batch, contract = (lb, lc) if operand == 0 else (rb, rc)
      dim_kind = "batch" if dim in batch else "contracting" if dim in contract else "free"
      base.update(operand=("lhs", "rhs")[operand], dim_kind=dim_kind)
    reason = (
        "untiled all_gather (adds a new axis)" if not p["tiled"] else
        f"multi-axis collective over {axes}" if len(axes) != 1 else
        "axis_index_groups are not supported" if p.get("axis_index_groups") is not None else
        broken if broken else
        "the gathered value is both operands of the matmul" if operand is None else
        "gathered dim is a batch dim of the matmul" if dim_kind == "batch" else
        f"dtype {deqn.outvars[0].aval.dtype} is not one of {FUSABLE_DTYPES}"
        if str(deqn.outvars[0].aval.dtype) not in FUSABLE_DTYPES
        or any(str(x.aval.dtype) not in FUSABLE_DTYPES for x in deqn.invars) else
        "the gathered value is used before the matmul" if any(i < di for i in ctx.uses[v]) else
        None)
    if reason:
      self._record(Match(status="skipped", reason=reason, **base))
      return False
    need_gathered = len(ctx.uses[v]) > 1 or v in ctx.outvars
    match = Match(status="fused", reason="",
                  impl=_impl_note(ctx, "ag_matmul", deqn, operand, dim, n, axes[0]), **base)
    self._record(match)
    key = id(ctx.jaxpr)
    self.plan.actions[(key, gi)] = SKIP
    for ceqn, _ in chain:
      self.plan.actions[(key, ctx.jaxpr.eqns.index(ceqn))] = SKIP
    self.plan.actions[(key, di)] = AgPlan(match, geqn, tuple(chain), dim, deqn, operand, v,
                                          need_gathered)
    claimed.add(di)
    return True

  # -- dot_general -> psum_scatter -------------------------------------------------

  def _match_rs(self, ctx, ri, reqn, claimed) -> bool:
    p = reqn.params
    axes = tuple(p["axis_name"]) if isinstance(p["axis_name"], (tuple, list)) else (p["axis_name"],)
    d = int(p["scatter_dimension"])
    n = int(p.get("axis_size") or 0) or None
    # Walk back through layout ops to the producing dot_general.
    v, chain = reqn.invars[0], []
    while _jax.is_var(v) and v in ctx.producer:
      prod = ctx.jaxpr.eqns[ctx.producer[v]]
      if prod.primitive.name == "dot_general":
        break
      if prod.primitive.name not in LAYOUT_PRIMITIVES:
        return False
      chain.insert(0, prod)
      v = prod.invars[0]
    else:
      return False
    di = ctx.producer[v]
    deqn = ctx.jaxpr.eqns[di]
    base = dict(kind="matmul_rs", axis_name=axes[0] if len(axes) == 1 else axes, axis_size=n,
                collective_dim=d, lhs_shape=_shape(deqn.invars[0]),
                rhs_shape=_shape(deqn.invars[1]), out_shape=_shape(deqn.outvars[0]),
                dtype=str(reqn.outvars[0].aval.dtype), source=_jax.source_line(reqn),
                path=ctx.path)
    # The scattered dim, traced back from the collective to the dot output.
    dims, dim = [], d
    for ceqn in reversed(chain):
      dims.insert(0, dim)
      dim = dim_through(ceqn, dim, n or 1, forward=False) if dim is not None else None
    dim_kind = operand = None
    dd = DotDims(deqn.params["dimension_numbers"], *(x.aval.ndim for x in deqn.invars))
    nb, nlf = len(dd.lb), len(dd.lf)  # dot output dims: batch, lhs free, rhs free
    if dim is not None:
      dim_kind = "batch" if dim < nb else "free"
      operand = None if dim < nb else "lhs" if dim < nb + nlf else "rhs"
      base.update(operand=operand, dim_kind=dim_kind)
    intermediates = [deqn.outvars[0]] + [c.outvars[0] for c in chain[:-1]]
    reason = (
        "untiled psum_scatter" if not p["tiled"] else
        f"multi-axis collective over {axes}" if len(axes) != 1 else
        "axis_index_groups are not supported" if p.get("axis_index_groups") is not None else
        "the matmul already feeds a fused all_gather" if di in claimed else
        "the matmul result is also used elsewhere"
        if any(len(ctx.uses[x]) != 1 or x in ctx.outvars for x in intermediates) else
        "a layout op between matmul and psum_scatter splits the scattered dim" if dim is None else
        "scattered dim is a batch dim of the matmul" if dim_kind == "batch" else
        f"dtype {deqn.outvars[0].aval.dtype} is not one of {FUSABLE_DTYPES}"
        if str(deqn.outvars[0].aval.dtype) not in FUSABLE_DTYPES
        or any(str(x.aval.dtype) not in FUSABLE_DTYPES for x in deqn.invars) else
        None)
    if reason:
      self._record(Match(status="skipped", reason=reason, **base))
      return False
    op_idx, op_dim = (0, dd.lf[dim - nb]) if operand == "lhs" else (1, dd.rf[dim - nb - nlf])
    match = Match(status="fused", reason="",
                  impl=_impl_note(ctx, "matmul_rs", deqn, op_idx, op_dim, n, axes[0]), **base)
    self._record(match)
    key = id(ctx.jaxpr)
    self.plan.actions[(key, di)] = SKIP
    for ceqn in chain:
      self.plan.actions[(key, ctx.jaxpr.eqns.index(ceqn))] = SKIP
    self.plan.actions[(key, ri)] = RsPlan(match, deqn, dim, tuple(zip(chain, dims)), reqn)
    claimed.add(di)
    return True


@dataclasses.dataclass
class _Ctx:
  jaxpr: Any
  uses: dict
  producer: dict
  outvars: set
  path: str
  mesh: Any
  config: OverlapConfig


def _shape(v):
  return tuple(v.aval.shape)
