"""The matcher of shard_map bodies: all_gather -> dot_general and dot_general(s) -> psum_scatter.

Inside a shard_map body every collective is explicit.  It matches
  all_gather -> [layout ops] -> dot_general          (kind "ag_matmul")
  dot_general(s) -> [layout ops, add/add_any] -> reduce_scatter   (kind "matmul_rs")
Every all_gather / psum_scatter adjacent to a dot_general (directly or
through layout ops, casts and sums) becomes a `Match`, rewritten or skipped
with a reason, and the rewritten ones an `AgPlan` / `RsPlan` in the plan.

fp8 matmuls (rewrite/fp8.py's forms: fp8 operands, or their quantize-dequantize form) become
fp8 fused ops: the gather moves fp8 bytes (the shard is quantized before it), GEMM+RS sums
the partial products in the matmul's result dtype, the per-tensor scales go to the epilogue.

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

from jax_autooverlap import fp8 as formats
from jax_autooverlap.ops.dims import DotDims
from jax_autooverlap.ops.planning import describe
from jax_autooverlap.ops.registry import operand_dtype
from jax_autooverlap.reasons import Reason
from jax_autooverlap.rewrite import _jax, fp8, summed
from jax_autooverlap.rewrite.layout import LAYOUT_PRIMITIVES, dim_through
from jax_autooverlap.rewrite.match import SKIPPED, Match, status_of
from jax_autooverlap.rewrite.plan import (SKIP, AgPlan, AmaxPlan, Fp8AgPlan, Plan, RsPlan,
                                          dtype_reason)
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
  fp8: Any = None  # _Fp8Ag: an fp8 matmul (the chain is then empty)


@dataclasses.dataclass
class _Fp8Ag:
  """What an fp8 AG+GEMM needs besides an _AgCandidate's fields (rewrite/fp8.py)."""
  shard_var: Any
  shard_ops: tuple
  other: Any  # fp8.Dequantized of the other operand
  factors: tuple  # fp8.Factor of both operands
  gathered_var: Any  # the fp8 gathered value the program also reads (or None)
  skipped: tuple  # indices of the program's equations the fused op makes dead
  amax: tuple  # (abs eqn index, reduce_max eqn index) of the gathered value's amaxes
  first_use: int  # where the fused op is emitted
  dtypes: tuple  # (gathered operand's fp8 dtype, the other's)
  note: str


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
  fp8: tuple | None = None  # RsPlan.fp8 of an fp8 matmul


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

  def _status(self, ctx, kind, axis_name, lhs_shape, rhs_shape, operand, dim, dn, n, dtypes,
              out_dtype):
    """(status, impl note, skip reason) of a match that can be rewritten; dtypes: the (lhs,
    rhs) operands' formats."""
    if ctx.config.impl == "triton" and ctx.mesh is not None:
      platform = context.platform(ctx.mesh)
      if platform != "gpu":
        return SKIPPED, None, Reason("impl_unavailable", "OverlapConfig(impl='triton') needs "
                                     f"NVIDIA GPUs; this mesh is on {platform}")
    note = describe(kind, lhs_shape, rhs_shape, operand, dim, dn, n or 1,
                    operand_dtype(*dtypes), out_dtype, ctx.config, ctx.mesh, axis_name,
                    dtypes=tuple(dtypes))
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
    if tiled and len(axes) == 1 and p.get("axis_index_groups") is None:
      found = self._fp8_ag_candidate(ctx, gi, geqn, base, n or 1, d)
      if found is not None:
        return found
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

  def _fp8_ag_candidate(self, ctx, gi, geqn, base, n, d):
    """The gather as an fp8 AG+GEMM (rewrite/fp8.py's forms): an _AgCandidate, a skipped
    Match, or None (no fp8 matmul: the 16-bit rules apply)."""
    g = geqn.outvars[0]
    path = fp8.gather_path(ctx, g)
    if not path.dots:
      return None
    v = path.values[-1]
    if path.scale_layout is not None:  # quantized with a per-row/column/block scale
      if fp8.dequantized(ctx, v, stop={g}) is None and not any(
          formats.is_fp8(x.aval.dtype) for x in path.values):
        return None
      return self._skipped(base, ctx.jaxpr.eqns[path.dots[0]],
                           fp8.scale_layout_reason(path.scale_layout), len(path.dots))
    deq = fp8.dequantized(ctx, v, gathers=True)
    if deq is None or (not isinstance(deq, Reason) and deq.gather not in (None, geqn)):
      return None
    first_dot = ctx.jaxpr.eqns[path.dots[0]]
    if isinstance(deq, Reason):
      return self._skipped(base, first_dot, deq, len(path.dots))
    before = deq.gather is not None  # dequantized before the gather: gather the fp8 source
    if before:
      at = [k for k, _ in deq.moves].index("gather")
      ops = [("move", e, None) for _, e in deq.moves[:at]]
      after = [(e, None) for _, e in deq.moves[at + 1:]]
      shard_var, gathered_var = deq.source, None
    else:
      if deq.source not in path.values:
        return None
      kq = path.values.index(deq.source)
      ops = []
      after = [(e, op) for _, e, op in path.steps[:kq]] + [(e, None) for _, e in deq.moves]
      shard_var, gathered_var = geqn.invars[0], deq.source
    dim = d
    for e, op in after:
      if op is not None:
        ops.append(("elementwise", op, dim))
        continue
      dim = dim_through(e, dim, n, forward=True)
      if dim is None:
        return self._skipped(base, first_dot, Reason(
            "layout_splits_dim", f"layout op {e.primitive.name} between gather and matmul "
            "splits the gathered dim"), len(path.dots))
      ops.append(("gathered", e, dim))
    # the matmul: v one operand, the other an fp8 operand too, a bf16/f32 result
    choice, reason = None, None
    for di in path.dots:
      deqn = ctx.jaxpr.eqns[di]
      where = _operand(deqn, v, dim)
      out = deqn.outvars[0].aval.dtype
      other = None if where is None else fp8.dequantized(ctx, deqn.invars[1 - where[0]])
      why = (Reason("both_operands", "the gathered value is both operands of the matmul")
             if where is None else
             Reason("batch_dim", "gathered dim is a batch dim of the matmul")
             if where[1] == "batch" else
             Reason("fp8_result", f"the fp8 matmul's result is {formats.name(out)}; the fused "
                    f"fp8 ops give {' or '.join(formats.FP8_OUT_DTYPES)}")
             if formats.name(out) not in formats.FP8_OUT_DTYPES else
             Reason("fp8_one_operand", f"the gathered operand is fp8 "
                    f"({formats.short(deq.source.aval.dtype)}), the other "
                    f"({formats.name(deqn.invars[1 - where[0]].aval.dtype)}) is not an fp8 "
                    "value or its dequantization") if other is None else
             other if isinstance(other, Reason) else None)
      if why is None and (choice is None or (choice[2] != "free" and where[1] == "free")):
        choice = (di, *where, other)
      reason = reason or why
    if choice is None:
      if before:
        return None  # the 16-bit rules fuse the dequantized gather
      return self._skipped(base, first_dot, reason, len(path.dots), _operand(first_dot, v, dim))
    di, operand, kind, other = choice
    # The path's values read elsewhere: the amaxes of the gathered value are computed from
    # the shards; the gathered fp8 value is the fused op's (where it is the matmul operand's
    # layout); program outputs keep the path up to them (XLA drops what ends up unused);
    # any other reader stays unfused.
    amax, keep, need, side_reads = [], -1, False, []
    for idx, u in enumerate(path.values):
      nxt = path.steps[idx][0] if idx < len(path.steps) else di
      side = [i for i in ctx.uses[u] if i != nxt]
      if idx == 0:
        for i in list(side):
          pair = fp8.amax_use(ctx, u, i)
          if pair is not None:
            amax.append((i, ctx.jaxpr.eqns.index(pair[1])))
            side.remove(i)
      if u is gathered_var and not deq.moves:
        need = bool(side) or u in ctx.outvars
        side_reads += side
        continue
      if side:
        if before:
          return None
        names = ", ".join(sorted({ctx.jaxpr.eqns[i].primitive.name for i in side}))
        return self._skipped(base, ctx.jaxpr.eqns[di], Reason(
            "fp8_gathered_used", f"the gathered value is also read unquantized ({names}): an "
            "fp8 gather would not replace the 16-bit one"), len(path.dots), (operand, kind))
      if u in ctx.outvars:
        keep = idx
    first_use = min([di, *side_reads])
    values = set(path.values)
    needed = [other.source] + [f.scalar.var for f in (*deq.factors, *other.factors)] + [
        sc.var for kind_, op, _ in ops if kind_ == "elementwise" for _, sc in op.scalars]
    if not all(ctx.available_at(x, first_use, values) for x in needed):
      return self._skipped(base, ctx.jaxpr.eqns[di], Reason(
          "operand_from_gather", "the matmul's other operand or a scale is computed from the "
          "gathered value (or after its first use)"), len(path.dots), (operand, kind))
    skipped = ([gi] if keep < 0 else []) + [i for i, _, _ in path.steps[max(keep, 0):]]
    if before:
      note = (f"fp8: the gather moves the {formats.short(deq.source.aval.dtype)} source of the "
              "dequantized shard; its scale goes to the GEMM's epilogue")
    elif not any(k == "elementwise" for k, _, _ in ops):
      note = f"fp8: the gather moves {formats.short(deq.source.aval.dtype)} bytes; one fp8 GEMM"
    else:
      quant = ", ".join(dict.fromkeys(op.name for k, op, _ in ops if k == "elementwise"))
      note = (f"fp8: the shard is quantized before the gather ({quant}), the gather moves "
              f"{formats.short(deq.source.aval.dtype)} bytes; the per-tensor scales go to the "
              "GEMM's epilogue")
    if amax:
      note += (f"; the gathered value's amax is the max over {base['axis_name']!r} of the "
               "shards' amaxes")
    if keep >= 0:
      note += ("; the unquantized gathered value is also a program output: its all_gather stays "
               "(XLA drops it where that output is unused)")
    nbytes = math.prod(v.aval.shape) * np.dtype(deq.source.aval.dtype).itemsize
    info = _Fp8Ag(shard_var, tuple(ops), other, (*deq.factors, *other.factors),
                  gathered_var if need else None, tuple(skipped), tuple(amax), first_use,
                  (deq.source.aval.dtype, other.source.aval.dtype), note)
    return _AgCandidate(gi, geqn, base, [], v, dim, [di], [(di, operand, kind)], nbytes, info)

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
      first_use = c.fp8.first_use if c.fp8 else min(ctx.uses[c.value])
      # values of planned gathers that are not there yet where this op is emitted
      later = {v for v, (at, before) in emitted.items() if at > first_use
               or (at == first_use and not before)} | {c.value}
      choice, why_not = None, None
      for di, operand, kind in c.eligible:
        other = c.fp8.other.source if c.fp8 else ctx.jaxpr.eqns[di].invars[1 - operand]
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
      dtypes = [a.aval.dtype for a in deqn.invars]
      if c.fp8:  # the fp8 operands, in the matmul's order
        dtypes = list(c.fp8.dtypes) if operand == 0 else list(reversed(c.fp8.dtypes))
        notes[c.gi].insert(0, c.fp8.note)
      status, impl, reason = self._status(
          ctx, "ag_matmul", c.base["axis_name"], lhs, rhs, operand, c.dim,
          deqn.params["dimension_numbers"], c.base["axis_size"], dtypes,
          deqn.outvars[0].aval.dtype)
      fields = dict(c.base, operand=("lhs", "rhs")[operand], dim_kind=kind, lhs_shape=lhs,
                    rhs_shape=rhs, out_shape=_shape(deqn.outvars[0]),
                    dtype=_dtype(deqn, dtypes if c.fp8 else None), n_dots=len(c.dots),
                    dot_source=_jax.source_line(deqn), note="; ".join(notes[c.gi]))
      match = Match(status=status, reason=reason, impl=impl, **fields)
      out.append((c.gi, match))
      if status == SKIPPED:
        continue
      if c.fp8:
        self._plan_fp8_ag(ctx, c, match, di, operand)
        claimed.add(di)
        emitted[c.value] = (first_use, first_use != di)
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

  def _plan_fp8_ag(self, ctx, c, match, di, operand):
    key, f = id(ctx.jaxpr), c.fp8
    deqn = ctx.jaxpr.eqns[di]
    for i in f.skipped:
      self.plan.actions[(key, i)] = SKIP
    for abs_i, red_i in f.amax:
      self.plan.actions[(key, abs_i)] = SKIP
      self.plan.actions[(key, red_i)] = AmaxPlan(
          match, c.geqn.invars[0], match.axis_name, ctx.jaxpr.eqns[red_i],
          (ctx.jaxpr.eqns[abs_i], ctx.jaxpr.eqns[red_i]))
    replaced = tuple(ctx.jaxpr.eqns[i] for i in sorted({*f.skipped, di}))
    plan = Fp8AgPlan(match, f.shard_var, f.shard_ops, c.dim, deqn, operand, f.other, f.factors,
                     f.gathered_var, replaced)
    if f.first_use == di:
      self.plan.actions[(key, di)] = plan
    else:  # computed where the gathered value is first read; the matmul's place is empty
      self.plan.emit_before.setdefault((key, f.first_use), []).append(plan)
      self.plan.actions[(key, di)] = SKIP

  # -- dot_general(s) -> psum_scatter ------------------------------------------------

  def _summands(self, ctx, v):
    """Matmuls summed into v through layout ops, add_any and scalings by per-tensor scalars.

    Returns ([(dot index, layout eqns from the dot to v)], [indices of the layout, add_any
    and scaling eqns in between], [names of other terms], [fp8.Factor of the scalings]).
    """
    leaves, inner, others, scales = [], [], [], []

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
      elif fp8.scaling(ctx, eqn) is not None:  # factor: an fp8.Factor, or a non-scalar's shape
        value, factor = fp8.scaling(ctx, eqn)
        inner.append(i)
        scales.append(factor)
        visit(value, path)
      else:
        others.append(name)

    visit(v, [])
    return sorted(leaves), sorted(set(inner)), others, scales

  def _rs_candidate(self, ctx, ri, reqn):
    """An _RsCandidate, a skipped Match, or None (not next to a matmul)."""
    p = reqn.params
    axes = _axes(p["axis_name"])
    d = int(p["scatter_dimension"])
    n = int(p.get("axis_size") or 0) or None
    leaves, inner, others, scales = self._summands(ctx, reqn.invars[0])
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
    fp8_info, fp8_reason = self._fp8_rs(ctx, dots, scales)
    if fp8_info is not None or fp8_reason is not None:
      lhs_dt, rhs_dt = ((fp8_info[0].source, fp8_info[1].source) if fp8_info else deqn.invars)
      base["dtype"] = (f"{formats.short(lhs_dt.aval.dtype)}x{formats.short(rhs_dt.aval.dtype)}"
                       f"->{base['dtype']}")
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
        fp8_reason or
        (Reason("sum_not_mergeable", merge_reason) if merge_reason and not fp8_info else None) or
        (None if fp8_info else next((r for r in map(dtype_reason, dots) if r), None)))
    if reason:
      return Match(status=SKIPPED, reason=reason, **base)
    op_idx, op_dim = (0, dd.lf[dim - nb]) if operand == "lhs" else (1, dd.rf[dim - nb - nlf])
    emit_chain = path[:-1] if untiled_ok else path  # the last reshape: to the scatter's shape
    nbytes = math.prod(reqn.invars[0].aval.shape) * np.dtype(reqn.invars[0].aval.dtype).itemsize
    return _RsCandidate(ri, reqn, base, dots, dot_idx, inner, dim, tuple(zip(emit_chain, dims)),
                        dn, op_idx, op_dim, nbytes, fp8_info)

  def _fp8_rs(self, ctx, dots, scales):
    """(RsPlan.fp8, None) for an fp8 matmul before a psum_scatter (rewrite/fp8.py's forms),
    (None, Reason) for an fp8 one the fused ops cannot take, (None, None) for a 16-bit one:
    a matmul of dequantized operands is fused as an fp8 GEMM only where both are."""
    views = [(fp8.dequantized(ctx, d.invars[0]), fp8.dequantized(ctx, d.invars[1])) for d in dots]
    raw = any(formats.is_fp8(x.aval.dtype) for d in dots for x in d.invars)
    if not raw and not all(a is not None and b is not None for a, b in views):
      if scales:
        return None, Reason("sum_other_terms", "the scattered value scales the matmul's result "
                            "(by a per-tensor scalar): fused for fp8 matmuls only")
      return None, None
    layout = next((f for f in scales if not isinstance(f, fp8.Factor)), None)
    (lhs, rhs), out = views[0], dots[0].outvars[0].aval.dtype
    reason = (
        Reason("sum_not_mergeable", "a sum of fp8 matmuls, each with its own scales, is not one "
               "GEMM") if len(dots) > 1 else
        fp8.scale_layout_reason(layout) if layout is not None else
        next((v for v in (lhs, rhs) if isinstance(v, Reason)), None) or
        (Reason("fp8_one_operand", "one operand of the matmul is fp8 (or dequantized from fp8), "
                "the other is not") if lhs is None or rhs is None else
         Reason("fp8_result", f"the fp8 matmul's result is {formats.name(out)}; the fused fp8 ops "
                f"give {' or '.join(formats.FP8_OUT_DTYPES)}")
         if formats.name(out) not in formats.FP8_OUT_DTYPES else None))
    if reason:
      return None, reason
    return (lhs, rhs, (*lhs.factors, *rhs.factors, *scales)), None

  def _plan_rs(self, ctx, c, claimed) -> Match:
    if any(i in claimed for i in c.dot_idx):
      return Match(status=SKIPPED, reason=Reason("one_per_matmul", "the matmul already holds a "
                                                 "fused all_gather (one fused op per matmul)"),
                   **c.base)
    deqn = c.dots[0]
    lhs, rhs = c.fp8[:2] if c.fp8 else deqn.invars
    if c.fp8:
      lhs, rhs = lhs.source, rhs.source
    out = deqn.outvars[0].aval.dtype
    status, impl, reason = self._status(
        ctx, "matmul_rs", c.base["axis_name"], c.base["lhs_shape"], c.base["rhs_shape"],
        c.op_idx, c.op_dim, c.dn, c.base["axis_size"], (lhs.aval.dtype, rhs.aval.dtype), out)
    note = (f"fp8: one fp8 GEMM, the per-tensor scales in its epilogue; the partial products "
            f"are summed in {formats.name(out)} (the matmul's result dtype), never in fp8"
            if c.fp8 else "")
    match = Match(status=status, reason=reason, impl=impl, note=note, **c.base)
    if status == SKIPPED:
      return match
    key = id(ctx.jaxpr)
    for i in (*c.dot_idx, *c.inner):
      self.plan.actions[(key, i)] = SKIP
    replaced = tuple(ctx.jaxpr.eqns[i] for i in sorted({*c.dot_idx, *c.inner, c.ri}))
    self.plan.actions[(key, c.ri)] = RsPlan(match, deqn, c.dim, c.chain, c.reqn, tuple(c.dots),
                                            replaced, c.fp8)
    claimed.update(c.dot_idx)
    return match


def _dtype(deqn, fp8_dtypes=None) -> str:
  """A match's dtype column: the matmul's result dtype, after its fp8 operands' formats."""
  out = str(deqn.outvars[0].aval.dtype)
  if fp8_dtypes is None:
    return out
  return f"{formats.short(fp8_dtypes[0])}x{formats.short(fp8_dtypes[1])}->{out}"


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
