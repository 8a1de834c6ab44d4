"""The matcher of shard_map bodies: all_gather -> dot_general and dot_general(s) -> psum_scatter.

Inside a shard_map body every collective is explicit.  It matches
  all_gather -> [layout ops] -> dot_general          (kind "ag_matmul")
  dot_general(s) -> [layout ops, add/add_any] -> reduce_scatter   (kind "matmul_rs")
Every all_gather / psum_scatter adjacent to a dot_general (directly or
through layout ops, casts and sums) becomes a `Match`, rewritten or skipped
with a reason, and the rewritten ones an `AgPlan` / `RsPlan` in the plan.

One fused op per matmul: where several gathers feed one dot_general (FSDP
weight gather x sequence-parallel activations), one is fused and the others
stay plain all_gathers feeding it.  A gather is preferred where the GPU
kernel covers it (a free dim), then by the bytes it moves.  A matmul both
fed by a gather and reduce-scattered takes the psum_scatter unless the gather
is on a free dim and moves more bytes.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import numpy as np

from jax_autooverlap.ops.dims import DotDims
from jax_autooverlap.ops.planning import describe
from jax_autooverlap.reasons import Reason
from jax_autooverlap.rewrite import _jax, summed
from jax_autooverlap.rewrite.layout import LAYOUT_PRIMITIVES, dim_through
from jax_autooverlap.rewrite.match import SKIPPED, Match, status_of
from jax_autooverlap.rewrite.plan import SKIP, AgPlan, Plan, RsPlan, dtype_reason
from jax_autooverlap.runtime import context
from jax_autooverlap.tuning.config import OverlapConfig

# Sums the rewrite looks through between matmuls and a psum_scatter: add_any (what
# autodiff writes) and add (what users write; jaxpr operands of add have one shape).
ADDS = frozenset({"add_any", "add"})


def _axes(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _shape(v):
  return tuple(v.aval.shape)


@dataclasses.dataclass
class _Ctx:
  jaxpr: Any
  uses: dict
  producer: dict
  outvars: set
  path: str
  mesh: Any
  config: OverlapConfig
  phase: str = "fwd"

  def available_at(self, v, i: int, unavailable=frozenset(), depth: int = 8) -> bool:
    """Can operand v be had before equation i?

    Yes if it is defined there, or computed from such values by first-order,
    effect-free equations (e.g. the pvary JAX puts right before a matmul): the
    interpreter then computes them early.  Never from a value in `unavailable`.
    """
    if not _jax.is_var(v):
      return True
    if v in unavailable:
      return False
    if v not in self.producer or self.producer[v] < i:
      return True
    eqn = self.jaxpr.eqns[self.producer[v]]
    if depth == 0 or eqn.effects or _jax.sub_jaxprs(eqn.params):
      return False
    return all(self.available_at(x, i, unavailable, depth - 1) for x in eqn.invars)


@dataclasses.dataclass
class _AgCandidate:
  """An all_gather adjacent to a matmul, before one fused op per matmul is chosen."""
  gi: int
  geqn: Any
  base: dict  # Match fields shared by every outcome
  chain: list  # [(eqn, out_dim)]
  value: Any  # the chain's end, which the matmuls consume
  dim: int | None
  dots: list  # indices of the dot_generals consuming `value`
  eligible: list  # [(dot index, operand, dim kind)] that may take the fused op, preferred first
  nbytes: int  # size of the gathered value: what the gather moves


@dataclasses.dataclass
class _RsCandidate:
  """A psum_scatter of a matmul (or of a sum of matmuls) that can be fused."""
  ri: int
  reqn: Any
  base: dict  # Match fields
  dots: list  # the summed dot_general equations, in program order
  dot_idx: list  # and their indices
  inner: list  # indices of the layout ops and adds between them and the scatter
  dim: int  # dim of the dot output that is scattered
  chain: tuple  # ((eqn, out_dim), ...) applied to the scattered result
  dn: Any  # dimension numbers of the (merged) matmul
  op_idx: int  # operand whose free dim is scattered, and that dim
  op_dim: int
  nbytes: int  # size of the scattered value: what the scatter moves


class ShardMapMatcher:
  """Plans the fused ops of shard_map bodies (called by the traversal in analysis.py)."""

  def __init__(self, plan: Plan, config: OverlapConfig):
    self.plan = plan
    self.config = config
    self._matched = {}  # id(jaxpr) -> (its matches, changed): a jaxpr shared by call sites

  def match(self, jaxpr, path, mesh, phase) -> bool:
    """Plan one shard_map body (or a jaxpr inside one); True if any match is rewritten."""
    if id(jaxpr) in self._matched:  # one jaxpr called from several places: planned once
      matches, changed = self._matched[id(jaxpr)]
      self.plan.report.matches.extend(matches)
      return changed
    uses, producer, outvars = _jax.dataflow(jaxpr)
    ctx = _Ctx(jaxpr, uses, producer, outvars, path, mesh, self.config, phase)
    found = []  # (collective's equation index, Match)
    candidates = []
    for i, eqn in enumerate(jaxpr.eqns):
      if eqn.primitive.name == "all_gather":
        cand = self._ag_candidate(ctx, i, eqn)
        if isinstance(cand, Match):
          found.append((i, cand))
        elif cand is not None:
          candidates.append(cand)
    rs_candidates = []
    for i, eqn in enumerate(jaxpr.eqns):
      if eqn.primitive.name == "reduce_scatter":
        cand = self._rs_candidate(ctx, i, eqn)
        if isinstance(cand, Match):
          found.append((i, cand))
        elif cand is not None:
          rs_candidates.append(cand)
    # A matmul between a gather and a scatter takes one of them: the scatter unless the
    # gather is on a free dim (the GPU kernel covers it) and moves more bytes.
    scattered = {di: c.nbytes for c in rs_candidates for di in c.dot_idx}
    claimed = set()  # dot_generals that hold a fused op
    found += self._plan_ags(ctx, candidates, claimed, scattered)
    found += [(c.ri, self._plan_rs(ctx, c, claimed)) for c in rs_candidates]
    matches = [m for _, m in sorted(found, key=lambda t: t[0])]
    self.plan.report.matches.extend(matches)
    changed = any(m.rewritten for m in matches)
    self._matched[id(jaxpr)] = (matches, changed)
    return changed

  def _status(self, ctx, kind, axis_name, lhs_shape, rhs_shape, operand, dim, dn, n, dtype,
              out_dtype):
    """(status, impl note, skip reason) of a match that can be rewritten."""
    if ctx.config.impl == "triton" and ctx.mesh is not None:
      platform = context.platform(ctx.mesh)
      if platform != "gpu":
        return SKIPPED, None, Reason("impl_unavailable", "OverlapConfig(impl='triton') needs "
                                     f"NVIDIA GPUs; this mesh is on {platform}")
    note = describe(kind, lhs_shape, rhs_shape, operand, dim, dn, n or 1, dtype, out_dtype,
                    ctx.config, ctx.mesh, axis_name)
    if note.code == "impl_unavailable":  # a forced implementation that cannot run here
      return SKIPPED, None, note
    return status_of(note), note, ""

  # -- all_gather -> dot_general -----------------------------------------------

  def _ag_candidate(self, ctx, gi, geqn):
    """An _AgCandidate, a skipped Match, or None (not next to a matmul)."""
    p = geqn.params
    axes = _axes(p["axis_name"])
    d = int(p["all_gather_dimension"])
    n = int(p.get("axis_size") or 0) or None
    x = geqn.invars[0]
    tiled = bool(p["tiled"])
    # An untiled gather (new axis of size n at d) has the row-major layout of the
    # tiled gather of dim d: a reshape that follows it acts on the tiled shape.
    tiled_shape = None
    if not tiled and d < x.aval.ndim:
      tiled_shape = list(x.aval.shape)
      tiled_shape[d] *= n or 1
    # Follow single-use layout ops from the gathered value.
    v, chain, dim, broken = geqn.outvars[0], [], d, None
    while len(ctx.uses[v]) == 1 and v not in ctx.outvars:
      nxt = ctx.jaxpr.eqns[ctx.uses[v][0]]
      if nxt.primitive.name not in LAYOUT_PRIMITIVES:
        break
      untiled_step = not tiled and not chain
      if untiled_step and (nxt.primitive.name != "reshape" or tiled_shape is None):
        break
      new_dim = None if broken else dim_through(nxt, dim, n or 1, forward=True,
                                                shape=tiled_shape if untiled_step else None)
      if new_dim is None and broken is None:
        broken = Reason("layout_splits_dim", f"layout op {nxt.primitive.name} between gather and "
                        "matmul splits the gathered dim")
      chain.append((nxt, new_dim))
      dim = new_dim
      v = nxt.outvars[0]
    dots = [i for i in ctx.uses[v] if ctx.jaxpr.eqns[i].primitive.name == "dot_general"]
    base = dict(kind="ag_matmul", axis_name=axes[0] if len(axes) == 1 else axes, axis_size=n,
                collective_dim=d, source=_jax.source_line(geqn), path=ctx.path,
                phase=_jax.phase(geqn, ctx.phase))
    untiled = None
    if not tiled and not chain:
      untiled = Reason("untiled", "untiled all_gather with its new axis last: the gathered "
                       "blocks interleave, no tiled gather is equivalent" if tiled_shape is None
                       else "untiled all_gather (adds a new axis) not followed by a reshape "
                       f"merging it into dim {d}")
    if not dots:
      reached = self._dot_reached(ctx, geqn.outvars[0])
      if reached is None:
        return None  # not next to a matmul: not a candidate
      di, through = reached
      reason = untiled or (
          Reason("add_between", f"an add ({next(t for t in through if t in ADDS)}) sits between "
                 "the gather and the matmul") if set(through) & ADDS else
          Reason("used_on_the_way", "the gathered value is used elsewhere on its way to the "
                 f"matmul (only single-use layout ops may sit between; here: "
                 f"{', '.join(through)})"))
      return self._skipped(base, ctx.jaxpr.eqns[di], reason, n_dots=1)
    reason = untiled or (
        Reason("multi_axis", f"multi-axis collective over {axes}") if len(axes) != 1 else
        Reason("axis_index_groups", "axis_index_groups are not supported")
        if p.get("axis_index_groups") is not None else broken)
    first_use = min(ctx.uses[v])
    eligible, dot_reasons = [], {}  # dot_reasons: why a dot cannot take the fused op
    for di in dots:
      deqn = ctx.jaxpr.eqns[di]
      where = _operand(deqn, v, dim)
      if where is None:
        dot_reasons[di] = Reason("both_operands", "the gathered value is both operands of the "
                                 "matmul")
        continue
      operand, kind = where
      r = (Reason("batch_dim", "gathered dim is a batch dim of the matmul") if kind == "batch" else
           dtype_reason(deqn, gathered=operand) or
           (Reason("operand_from_gather", "the matmul's other operand is computed from the "
                   "gathered value (or after its first use, by a loop or call)")
            if not ctx.available_at(deqn.invars[1 - operand], first_use, {v}) else None))
      if r:
        dot_reasons[di] = r
      else:
        eligible.append((di, operand, kind))
    # Prefer a free-dim gather (the GPU kernel covers it), then program order.
    eligible.sort(key=lambda e: (e[2] != "free", e[0]))
    nbytes = math.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize
    if reason is None and not eligible:
      reason = dot_reasons[dots[0]]
    if reason:
      deqn = ctx.jaxpr.eqns[dots[0]]
      return self._skipped(base, deqn, reason, len(dots), _operand(deqn, v, dim))
    return _AgCandidate(gi, geqn, base, chain, v, dim, dots, eligible, nbytes)

  def _dot_reached(self, ctx, v, limit: int = 16):
    """(dot index, primitives on the way) of a matmul reached through layout ops / add_any."""
    frontier = [(v, ())]
    for _ in range(limit):
      nxt = []
      for value, through in frontier:
        for i in ctx.uses[value]:
          eqn = ctx.jaxpr.eqns[i]
          name = eqn.primitive.name
          if name == "dot_general":
            return i, through
          if name in LAYOUT_PRIMITIVES or name in ADDS:
            nxt += [(o, through + (name,)) for o in eqn.outvars]
      frontier = nxt
    return None

  def _skipped(self, base, deqn, reason, n_dots=1, operand=None):
    fields = dict(base)
    if operand is not None:
      fields.update(operand=("lhs", "rhs")[operand[0]], dim_kind=operand[1])
    return Match(status=SKIPPED, reason=reason, lhs_shape=_shape(deqn.invars[0]),
                 rhs_shape=_shape(deqn.invars[1]), out_shape=_shape(deqn.outvars[0]),
                 dtype=str(deqn.outvars[0].aval.dtype), n_dots=n_dots,
                 dot_source=_jax.source_line(deqn), **fields)

  def _plan_ags(self, ctx, cands, claimed, scattered) -> list:
    """One fused op per matmul: plan the candidates, preferred first; (index, Match) each.

    A planned gather's value exists only once its fused op is emitted (before the
    value's first use): a later-planned fused op may read it only if emitted after.
    """
    key = id(ctx.jaxpr)
    by_value = {c.value: c for c in cands}
    emitted = {}  # chain end of a planned gather -> (emission index, emitted before that eqn)
    plain = {}  # candidate gi -> why it stays a plain all_gather
    notes = defaultdict(list)
    out = []
    order = sorted(cands, key=lambda c: (c.eligible[0][2] != "free", -c.nbytes, c.gi))
    for c in order:
      if c.gi in plain:
        deqn = ctx.jaxpr.eqns[c.dots[0]]
        out.append((c.gi, self._skipped(c.base, deqn, plain[c.gi], len(c.dots),
                                        _operand(deqn, c.value, c.dim))))
        continue
      first_use = min(ctx.uses[c.value])
      # values of planned gathers that are not there yet where this op is emitted
      later = {v for v, (at, before) in emitted.items() if at > first_use
               or (at == first_use and not before)} | {c.value}
      choice, why_not = None, None
      for di, operand, kind in c.eligible:
        other = ctx.jaxpr.eqns[di].invars[1 - operand]
        if di in claimed:
          why_not = why_not or Reason("one_per_matmul", "its matmul already holds another fused "
                                      "op (one per matmul)")
        elif di in scattered and (kind != "free" or c.nbytes <= scattered[di]):
          why_not = why_not or Reason("one_per_matmul", "its matmul's result is reduce-scattered "
                                      "and that psum_scatter is fused instead (one fused op per "
                                      "matmul)")
        elif not ctx.available_at(other, first_use, later):
          why_not = why_not or Reason("operand_emitted_later", "the matmul's other operand "
                                      "comes from another fused gather emitted later")
        else:
          choice = (di, operand, kind)
          break
      if choice is None:
        deqn = ctx.jaxpr.eqns[c.dots[0]]
        out.append((c.gi, self._skipped(c.base, deqn, why_not, len(c.dots),
                                        _operand(deqn, c.value, c.dim))))
        continue
      di, operand, kind = choice
      deqn = ctx.jaxpr.eqns[di]
      other_gather = by_value.get(deqn.invars[1 - operand])
      if (other_gather is not None and other_gather.gi not in plain
          and other_gather.value not in emitted):
        axis = c.base["axis_name"]
        plain[other_gather.gi] = Reason(
            "one_per_matmul", f"one fused op per matmul: the matmul's other operand, gathered "
            f"over {axis!r}, is fused; this gather runs first as a plain all_gather")
        notes[c.gi].append(f"other operand gathered over {other_gather.base['axis_name']!r} "
                           "first (plain all_gather)")
      lhs, rhs = (_shape(a) for a in deqn.invars)
      dtype = deqn.invars[0].aval.dtype if deqn.invars[0].aval.dtype == deqn.invars[1].aval.dtype \
          else None
      status, impl, reason = self._status(
          ctx, "ag_matmul", c.base["axis_name"], lhs, rhs, operand, c.dim,
          deqn.params["dimension_numbers"], c.base["axis_size"], dtype,
          deqn.outvars[0].aval.dtype)
      fields = dict(c.base, operand=("lhs", "rhs")[operand], dim_kind=kind, lhs_shape=lhs,
                    rhs_shape=rhs, out_shape=_shape(deqn.outvars[0]),
                    dtype=str(deqn.outvars[0].aval.dtype), n_dots=len(c.dots),
                    dot_source=_jax.source_line(deqn), note="; ".join(notes[c.gi]))
      match = Match(status=status, reason=reason, impl=impl, **fields)
      out.append((c.gi, match))
      if status == SKIPPED:
        continue
      need_gathered = len(ctx.uses[c.value]) > 1 or c.value in ctx.outvars
      replaced = (c.geqn, *(e for e, _ in c.chain), deqn)
      plan = AgPlan(match, c.geqn, tuple(c.chain), c.dim, deqn, operand, c.value, need_gathered,
                    replaced)
      self.plan.actions[(key, c.gi)] = SKIP
      for ceqn, _ in c.chain:
        self.plan.actions[(key, ctx.jaxpr.eqns.index(ceqn))] = SKIP
      if first_use == di:
        self.plan.actions[(key, di)] = plan
      else:  # computed where the gathered value is first needed; the matmul's place is empty
        self.plan.emit_before.setdefault((key, first_use), []).append(plan)
        self.plan.actions[(key, di)] = SKIP
      claimed.add(di)
      emitted[c.value] = (first_use, first_use != di)
    return out

  # -- dot_general(s) -> psum_scatter ------------------------------------------------

  def _summands(self, ctx, v):
    """Matmuls summed into v through layout ops and add_any.

    Returns ([(dot index, layout eqns from the dot to v)], [indices of the layout
    and add_any eqns in between], [names of other terms]).
    """
    leaves, inner, others = [], [], []

    def visit(value, path):
      if not _jax.is_var(value) or value not in ctx.producer:
        others.append("an input of the program")
        return
      i = ctx.producer[value]
      eqn = ctx.jaxpr.eqns[i]
      name = eqn.primitive.name
      if name == "dot_general":
        leaves.append((i, tuple(path)))
      elif name in LAYOUT_PRIMITIVES:
        inner.append(i)
        visit(eqn.invars[0], [eqn, *path])
      elif name in ADDS:
        inner.append(i)
        for x in eqn.invars:
          visit(x, path)
      else:
        others.append(name)

    visit(v, [])
    return sorted(leaves), sorted(set(inner)), others

  def _rs_candidate(self, ctx, ri, reqn):
    """An _RsCandidate, a skipped Match, or None (not next to a matmul)."""
    p = reqn.params
    axes = _axes(p["axis_name"])
    d = int(p["scatter_dimension"])
    n = int(p.get("axis_size") or 0) or None
    leaves, inner, others = self._summands(ctx, reqn.invars[0])
    if not leaves:
      return None  # not next to a matmul: not a candidate
    dot_idx = [i for i, _ in leaves]
    dots = [ctx.jaxpr.eqns[i] for i in dot_idx]
    path = leaves[0][1]  # layout ops from the matmul to the scatter
    deqn = dots[0]
    out_shape = _shape(reqn.outvars[0])
    # An untiled psum_scatter whose input was reshaped to split the axis of size n
    # off dim d acts like the tiled psum_scatter of the merged dim.
    tiled = bool(p["tiled"])
    untiled_ok = (not tiled and path and path[-1].primitive.name == "reshape"
                  and d < len(out_shape))
    tiled_shape = list(out_shape)
    if untiled_ok:
      tiled_shape[d] *= n or 1
    base = dict(kind="matmul_rs", axis_name=axes[0] if len(axes) == 1 else axes, axis_size=n,
                collective_dim=d, dtype=str(reqn.outvars[0].aval.dtype),
                source=_jax.source_line(reqn), dot_source=_jax.source_line(deqn), path=ctx.path,
                phase=_jax.phase(reqn, ctx.phase), n_dots=len(dots))
    # The scattered dim, traced back from the collective to the dot output.
    dims, dim = [], d
    for j, ceqn in enumerate(reversed(path)):
      dims.insert(0, dim)
      shape = tiled_shape if untiled_ok and j == 0 else None
      dim = dim_through(ceqn, dim, n or 1, forward=False, shape=shape) if dim is not None else None
    if len(dots) > 1 and summed.merge_reason(dots) is None:
      lhs_shape, rhs_shape = summed.merged_shapes(dots)
      dn = summed.merged_dn(dots)
    else:
      lhs_shape, rhs_shape = _shape(deqn.invars[0]), _shape(deqn.invars[1])
      dn = deqn.params["dimension_numbers"]
    base.update(lhs_shape=lhs_shape, rhs_shape=rhs_shape, out_shape=_shape(deqn.outvars[0]))
    dd = DotDims(dn, len(lhs_shape), len(rhs_shape))
    nb, nlf = len(dd.lb), len(dd.lf)  # dot output dims: batch, lhs free, rhs free
    operand = None
    if dim is not None:
      dim_kind = "batch" if dim < nb else "free"
      operand = None if dim < nb else "lhs" if dim < nb + nlf else "rhs"
      base.update(operand=operand, dim_kind=dim_kind)
    intermediates = [e.outvars[0] for e in dots] + [ctx.jaxpr.eqns[i].outvars[0] for i in inner]
    signature = lambda chain: [(e.primitive.name, e.params) for e in chain]
    merge_reason = summed.merge_reason(dots) if len(dots) > 1 else None
    reason = (
        Reason("untiled", "untiled psum_scatter (not preceded by a reshape splitting the "
               f"scattered axis off dim {d})") if not tiled and not untiled_ok else
        Reason("multi_axis", f"multi-axis collective over {axes}") if len(axes) != 1 else
        Reason("axis_index_groups", "axis_index_groups are not supported")
        if p.get("axis_index_groups") is not None else
        Reason("sum_other_terms", f"the scattered value adds matmuls and other terms "
               f"({', '.join(others)}); only a sum of matmuls is fused") if others else
        Reason("result_used_elsewhere", "the matmul result is also used elsewhere")
        if any(len(ctx.uses[x]) != 1 or x in ctx.outvars for x in intermediates) else
        Reason("sum_layouts_differ", "the summed matmuls reach the sum through different layout "
               "ops") if any(not _same(signature(c), signature(path)) for _, c in leaves) else
        Reason("layout_splits_dim", "a layout op between matmul and psum_scatter splits the "
               "scattered dim") if dim is None else
        Reason("batch_dim", "scattered dim is a batch dim of the matmul") if operand is None else
        (Reason("sum_not_mergeable", merge_reason) if merge_reason else None) or
        next((r for r in map(dtype_reason, dots) if r), None))
    if reason:
      return Match(status=SKIPPED, reason=reason, **base)
    op_idx, op_dim = (0, dd.lf[dim - nb]) if operand == "lhs" else (1, dd.rf[dim - nb - nlf])
    emit_chain = path[:-1] if untiled_ok else path  # the last reshape: to the scatter's shape
    nbytes = math.prod(reqn.invars[0].aval.shape) * np.dtype(reqn.invars[0].aval.dtype).itemsize
    return _RsCandidate(ri, reqn, base, dots, dot_idx, inner, dim, tuple(zip(emit_chain, dims)),
                        dn, op_idx, op_dim, nbytes)

  def _plan_rs(self, ctx, c, claimed) -> Match:
    if any(i in claimed for i in c.dot_idx):
      return Match(status=SKIPPED, reason=Reason("one_per_matmul", "the matmul already holds a "
                                                 "fused all_gather (one fused op per matmul)"),
                   **c.base)
    deqn = c.dots[0]
    lhs_dtype, rhs_dtype = deqn.invars[0].aval.dtype, deqn.invars[1].aval.dtype
    status, impl, reason = self._status(
        ctx, "matmul_rs", c.base["axis_name"], c.base["lhs_shape"], c.base["rhs_shape"],
        c.op_idx, c.op_dim, c.dn, c.base["axis_size"],
        lhs_dtype if lhs_dtype == rhs_dtype else None, deqn.outvars[0].aval.dtype)
    match = Match(status=status, reason=reason, impl=impl, **c.base)
    if status == SKIPPED:
      return match
    key = id(ctx.jaxpr)
    for i in (*c.dot_idx, *c.inner):
      self.plan.actions[(key, i)] = SKIP
    replaced = tuple(ctx.jaxpr.eqns[i] for i in sorted({*c.dot_idx, *c.inner, c.ri}))
    self.plan.actions[(key, c.ri)] = RsPlan(match, deqn, c.dim, c.chain, c.reqn, tuple(c.dots),
                                            replaced)
    claimed.update(c.dot_idx)
    return match


def _operand(deqn, v, dim):
  """(operand index, kind of the gathered dim) of value v in a matmul; None if v is both."""
  if deqn.invars[0] is v and deqn.invars[1] is v:
    return None
  operand = 0 if deqn.invars[0] is v else 1
  if dim is None:
    return operand, None
  dd = DotDims(deqn.params["dimension_numbers"], *(a.aval.ndim for a in deqn.invars))
  (batch, contract, _), _ = dd.side(operand)
  return operand, "batch" if dim in batch else "contracting" if dim in contract else "free"


def _same(a, b) -> bool:
  try:
    return bool(a == b)
  except Exception:  # params holding arrays
    return False
