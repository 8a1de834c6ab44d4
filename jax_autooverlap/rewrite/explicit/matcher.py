"""The matcher of programs without shard_map: collectives read from explicit-sharding types.

  gather   `reshard` taking axis a off one dim (f32[64@tp,32] -> f32[64,32]),
           through layout ops, into dot_generals; or a dot_general with an
           operand dim sharded on a that the result does not keep, while the
           result is sharded on a through the other operand (what JAX's
           transposes of row-parallel matmuls write);
  scatter  a dot_general whose paired contracting dims are both sharded on a
           and whose result type shards a free dim on a (`out_sharding`); or
           such a matmul with a replicated result (an all-reduce), or a sum
           (`add_any`) of several, through layout ops into a `reshard` adding
           a to one dim (the transpose of a gather).

fp8 matmuls (rewrite/fp8.py's forms: both operands fp8 values or their per-tensor
dequantizations) run the fp8 fused ops: the fp8 sources are gathered or multiplied, the
scales go to the epilogue.

Each becomes an action (rewrite/explicit/actions.py) running the fused op in
a shard_map.  A sum of k matmuls is one GEMM over their local operands
concatenated along a contracting dim.  Every candidate becomes a `Match`
(origin "explicit").
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
from jax_autooverlap.rewrite import _jax, fp8
from jax_autooverlap.rewrite.explicit.actions import (AgFusion, Bind, GatheredDot, RsFusion, Then,
                                                      producers_first)
from jax_autooverlap.rewrite.explicit.sharding import (classify, drop, local_shape, mesh_of, pspec,
                                                       reshard_change, spec_of)
from jax_autooverlap.rewrite.layout import LAYOUT_PRIMITIVES, dim_through
from jax_autooverlap.rewrite.match import Match, status_of
from jax_autooverlap.rewrite.plan import SKIP, dtype_reason
from jax_autooverlap.runtime import context

ORIGIN = "explicit"
_BOTH_OPERANDS = Reason("both_operands", "the gathered value is both operands of the matmul")


def match(plan, config, jaxpr, path: str, phase: str = "fwd") -> bool:
  """Plan the fused ops of one jaxpr outside shard_map; True if any was planned."""
  return _Matcher(plan, config, jaxpr, path, phase).run()


@dataclasses.dataclass
class _Gather:
  """A reshard gathering `axis` off dim `dim` of `shard`, then layout ops, into dots."""
  index: int
  eqn: Any
  axis: str
  dim: int
  chain: list
  gather_dim: int | None
  broken: Reason | None
  value: Any  # the chain's end: what the dots consume
  dots: list
  nbytes: int


class _Matcher:

  def __init__(self, plan, config, jaxpr, path, phase):
    self.plan, self.config, self.jaxpr, self.path, self.phase = plan, config, jaxpr, path, phase
    self.eqns = jaxpr.eqns
    self.uses, self.producer, self.outvars = _jax.dataflow(jaxpr)
    # The GPU kernels need the concrete mesh: jax.set_mesh's, or the one a reshard names.
    self.cmesh = context.current_mesh() or next(
        (e.params["concrete_mesh"] for e in self.eqns if e.primitive.name == "reshard"
         and e.params.get("concrete_mesh") is not None), None)
    self.claimed: dict[int, str] = {}  # dot index -> the fused collective's axis
    self.ahead = defaultdict(list)  # eqn index -> fused ops that run just before it

  def run(self) -> bool:
    changed = False
    gathers = [g for i, e in enumerate(self.eqns) if e.primitive.name == "reshard"
               for g in [self._gather(i, e)] if g is not None]
    # One fused gather per matmul: the larger transfer first.
    for g in sorted(gathers, key=lambda g: (-g.nbytes, g.index)):
      changed |= self._fuse_gather(g)
    groups = defaultdict(list)
    for i, eqn in enumerate(self.eqns):
      if eqn.primitive.name != "dot_general" or i in self.claimed:
        continue
      comm = self._comm(eqn)
      if comm is not None and comm.kind == "ag":
        groups[(eqn.invars[comm.operand], comm.dim, comm.axis)].append((i, comm))
      elif comm is not None and comm.kind == "rs":
        changed |= self._fuse_rs(i, [eqn], comm.axis, comm.dim, comm.dim, [], eqn,
                                 comm.summed)
    for members in groups.values():
      changed |= self._fuse_implicit_gather(members)
    for i, eqn in enumerate(self.eqns):
      if eqn.primitive.name == "reshard":
        changed |= self._scatter(i, eqn)
    for i, fusions in self.ahead.items():  # fused ops run before their first consumer's action
      own = self.plan.actions.get((id(self.jaxpr), i))
      rest = [] if own is SKIP else [Bind(self.eqns[i])] if own is None else [own]
      self._act(i, Then((*producers_first(fusions), *rest)))
    return changed

  # -- helpers --------------------------------------------------------------------

  def _record(self, match: Match):
    self.plan.report.matches.append(match)

  def _skip(self, *indices):
    for i in indices:
      self.plan.actions[(id(self.jaxpr), i)] = SKIP

  def _act(self, i, action):
    self.plan.actions[(id(self.jaxpr), i)] = action

  def _comm(self, eqn):
    specs = [spec_of(v) for v in (*eqn.invars, eqn.outvars[0])]
    if any(s is None for s in specs):
      return None
    dd = DotDims(eqn.params["dimension_numbers"], *(v.aval.ndim for v in eqn.invars))
    return classify(dd, *specs)

  def _cmesh_for(self, mesh):
    cmesh = self.cmesh
    return cmesh if cmesh is not None and cmesh.abstract_mesh == mesh else None

  def _available_at(self, eqn, i) -> bool:
    return all(self.producer.get(v, -1) < i for v in eqn.invars if _jax.is_var(v))

  def _base(self, kind, axis, n, collective_dim, deqn, shapes, source_eqn):
    return dict(kind=kind, axis_name=axis, axis_size=n, collective_dim=collective_dim,
                lhs_shape=shapes[0], rhs_shape=shapes[1], out_shape=shapes[2],
                dtype=str(deqn.outvars[0].aval.dtype), source=_jax.source_line(source_eqn),
                dot_source=_jax.source_line(deqn), path=self.path, origin=ORIGIN,
                phase=_jax.phase(source_eqn, self.phase))

  def _impl(self, kind, deqn, shapes, operand, dim, n, mesh, views=None):
    lhs, rhs = (v.source for v in views) if views else deqn.invars
    impl = describe(kind, shapes[0], shapes[1], operand, dim, deqn.params["dimension_numbers"],
                    n, operand_dtype(lhs.aval.dtype, rhs.aval.dtype), deqn.outvars[0].aval.dtype,
                    self.config, self._cmesh_for(mesh), dtypes=(lhs.aval.dtype, rhs.aval.dtype))
    if not views:
      return impl
    what = ("the fp8 sources are gathered" if kind == "ag_matmul" else
            f"the partial products are summed in {formats.name(deqn.outvars[0].aval.dtype)}")
    return Reason(impl.code, f"{impl}; fp8 ({formats.short(lhs.aval.dtype)} x "
                  f"{formats.short(rhs.aval.dtype)}): {what}, the per-tensor scales go to the "
                  "GEMM's epilogue")

  def _fp8(self, deqn, gathered=None):
    """(views, None) if the matmul is an fp8 one the fused ops take: its operands fp8 values
    or their dequantizations with per-tensor scales (fp8.Dequantized each; `gathered`: the
    gathered operand's value is that var's, e.g. a reshard's input); (None, Reason) for an
    fp8 one they cannot take; (None, None) for a 16-bit matmul (the 16-bit rules apply)."""
    values = list(deqn.invars)
    if gathered is not None:
      values[gathered[0]] = gathered[1]
    views = [fp8.dequantized(self, v) for v in values]
    raw = any(formats.is_fp8(v.aval.dtype) for v in deqn.invars)
    if not raw and any(v is None for v in views):
      return None, None
    out = deqn.outvars[0].aval.dtype
    reason = (next((v for v in views if isinstance(v, Reason)), None) or
              (Reason("fp8_one_operand", "one operand of the matmul is fp8 (or dequantized from "
                      "fp8), the other is not") if any(v is None for v in views) else
               Reason("fp8_result", f"the fp8 matmul's result is {formats.name(out)}; the fused "
                      f"fp8 ops give {' or '.join(formats.FP8_OUT_DTYPES)}")
               if formats.name(out) not in formats.FP8_OUT_DTYPES else None))
    return (None, reason) if reason else (tuple(views), None)

  @staticmethod
  def _dtype(base, views):
    if views:
      base["dtype"] = (f"{formats.short(views[0].source.aval.dtype)}x"
                       f"{formats.short(views[1].source.aval.dtype)}->{base['dtype']}")

  # -- gathers ----------------------------------------------------------------------

  def _gather(self, i, eqn) -> _Gather | None:
    change = reshard_change(eqn)
    if change is None or change[0] != "gather":
      return None
    _, axis, dim = change
    n = mesh_of(eqn.invars[0]).shape[axis]
    v, chain, gdim, broken = eqn.outvars[0], [], dim, None
    while len(self.uses[v]) == 1 and v not in self.outvars:
      nxt = self.eqns[self.uses[v][0]]
      if nxt.primitive.name not in LAYOUT_PRIMITIVES:
        break
      new = dim_through(nxt, gdim, n, forward=True) if broken is None else None
      if spec_of(nxt.outvars[0]) is None and broken is None:
        new, broken = None, Reason("no_sharding_type", f"layout op {nxt.primitive.name} has no "
                                   "usable sharding type")
      if new is None and broken is None:
        broken = Reason("layout_splits_dim", f"layout op {nxt.primitive.name} between gather and "
                        "matmul splits the gathered dim")
      chain.append((nxt, new))
      gdim, v = new, nxt.outvars[0]
    dots = [j for j in self.uses[v] if self.eqns[j].primitive.name == "dot_general"]
    if not dots:
      return None  # not next to a matmul: not a candidate
    aval = eqn.invars[0].aval
    return _Gather(i, eqn, axis, dim, chain, gdim, broken, v, dots,
                   math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)

  def _gather_kind(self, j, value, dim):
    """(operand index, kind of the gathered dim) of dot j consuming `value`; (None, None) if
    `value` is both its operands."""
    e = self.eqns[j]
    if e.invars[0] is value and e.invars[1] is value:
      return None, None
    x = 0 if e.invars[0] is value else 1
    (ab, ac, _), _ = DotDims(e.params["dimension_numbers"], *(v.aval.ndim for v in e.invars)).side(x)
    return x, "batch" if dim in ab else "contracting" if dim in ac else "free"

  def _pick(self, dots, value, dim):
    """The dot to fuse among those consuming one gathered value: one whose operands exist at
    the first (the fused op runs there; the others read its gathered value), a free-dim
    gather (what the GPU kernel covers) first."""
    first = dots[0]
    options = [j for j in dots if j not in self.claimed and self._available_at(self.eqns[j], first)]
    free = lambda j: self._gather_kind(j, value, dim)[1] == "free"
    return min(options, key=lambda j: (not free(j), j)) if options else first

  def _place(self, first, chosen, fusion):
    """The fused op runs at the first consumer; the chosen dot's own equation is dropped."""
    self.ahead[first].append(fusion)
    self._skip(chosen)
    self.claimed[chosen] = fusion.match.axis_name

  def _fuse_gather(self, g: _Gather) -> bool:
    first = g.dots[0]
    di = self._pick(g.dots, g.value, g.gather_dim) if g.gather_dim is not None else first
    deqn = self.eqns[di]
    mesh = mesh_of(g.eqn.invars[0])
    n = mesh.shape[g.axis]
    x, dim_kind = self._gather_kind(di, g.value, g.gather_dim)
    comm = None if x is None else self._comm(deqn)
    specs = [spec_of(v) for v in (*deqn.invars, deqn.outvars[0])]
    shapes = [local_shape(v, s, mesh) if s is not None else tuple(v.aval.shape)
              for v, s in zip((*deqn.invars, deqn.outvars[0]), specs)]
    base = self._base("ag_matmul", g.axis, n, g.dim, deqn, shapes, g.eqn)
    base["n_dots"] = len(g.dots)
    if x is not None and g.gather_dim is not None:
      base.update(operand=("lhs", "rhs")[x], dim_kind=dim_kind)
    # fp8: the reshard gathers a dequantized value (its fp8 source is gathered instead), or an
    # fp8 one; the gathered value must then feed this matmul only
    views, fp8_reason = (None, None) if x is None else self._fp8(deqn, (x, g.eqn.invars[0]))
    if views and (len(self.uses[g.value]) > 1 or g.value in self.outvars):
      views, fp8_reason = None, None if not any(formats.is_fp8(v.aval.dtype)
                                               for v in deqn.invars) else Reason(
          "fp8_gathered_used", "the gathered value is also read elsewhere: an fp8 gather would "
          "not replace it")
    self._dtype(base, views)
    reason = (
        g.broken if g.broken else
        _BOTH_OPERANDS if x is None else
        Reason("batch_dim", "gathered dim is a batch dim of the matmul") if dim_kind == "batch"
        else Reason("one_per_matmul", f"the matmul's other operand, gathered over "
                    f"{self.claimed[di]!r} (a larger transfer), is fused into it instead; this "
                    "gather runs first, unfused") if di in self.claimed else
        fp8_reason or (None if views else dtype_reason(deqn, gathered=x)) or
        (Reason("used_before", "the gathered value is used before the matmul")
         if any(j < first for j in self.uses[g.value]) else None))
    if reason is None and (comm is None or comm.kind != "local" or g.axis in comm.summed):
      reason = Reason("communicates_besides", "the matmul communicates besides this gather "
                      f"(operand shardings {pspec(specs[0])} x {pspec(specs[1])} -> "
                      f"{pspec(specs[2])})")
    if reason:
      self._record(Match(status="skipped", reason=reason, **base))
      return False
    need = len(self.uses[g.value]) > 1 or g.value in self.outvars
    impl = self._impl("ag_matmul", deqn, shapes, x, g.gather_dim, n, mesh, views)
    match = Match(status=status_of(impl), reason="", impl=impl, **base)
    self._record(match)
    self._skip(g.index, *(self.eqns.index(c) for c, _ in g.chain))
    self._place(first, di, AgFusion(
        match, g.eqn.invars[0], spec_of(g.eqn.invars[0]), tuple(g.chain), g.gather_dim, deqn, x,
        (specs[1 - x], specs[2], specs[x]), tuple(sorted(comm.summed)),
        g.value if need else None, mesh, self._cmesh_for(mesh),
        views and (views[x], views[1 - x])))
    return True

  def _fuse_implicit_gather(self, members) -> bool:
    """Dots that each gather the same value: one fused op, the others reuse its gathered value."""
    comms = dict(members)
    first, (v, dim) = members[0][0], (self.eqns[members[0][0]].invars[members[0][1].operand],
                                      members[0][1].dim)
    i = self._pick([j for j, _ in members], v, dim)
    comm, deqn = comms[i], self.eqns[i]
    mesh = mesh_of(v)
    n = mesh.shape[comm.axis]
    specs = [spec_of(u) for u in (*deqn.invars, deqn.outvars[0])]
    gathered_spec = drop(specs[comm.operand], comm.dim)
    shapes = [local_shape(u, s, mesh) for u, s in zip((*deqn.invars, deqn.outvars[0]), specs)]
    shapes[comm.operand] = local_shape(v, gathered_spec, mesh)
    x, dim_kind = self._gather_kind(i, v, dim)
    base = self._base("ag_matmul", comm.axis, n, comm.dim, deqn, shapes, deqn)
    base["n_dots"] = len(members)
    if x is not None:
      base.update(operand=("lhs", "rhs")[x], dim_kind=dim_kind)
    views, fp8_reason = (None, None) if x is None else self._fp8(deqn)
    if views and len(members) > 1:  # the others would read the gathered 16-bit value
      views, fp8_reason = None, None if not any(formats.is_fp8(u.aval.dtype)
                                               for u in deqn.invars) else Reason(
          "fp8_gathered_used", "several matmuls read the gathered value: an fp8 gather would "
          "not replace it")
    self._dtype(base, views)
    reason = _BOTH_OPERANDS if x is None else fp8_reason or (
        None if views else dtype_reason(deqn, gathered=x))
    if reason:
      self._record(Match(status="skipped", reason=reason, **base))
      return False
    impl = self._impl("ag_matmul", deqn, shapes, comm.operand, comm.dim, n, mesh, views)
    match = Match(status=status_of(impl), reason="", impl=impl, **base)
    self._record(match)
    key = object() if len(members) > 1 else None  # env key of the gathered value
    for j, c in members:
      if j != i:
        self._act(j, GatheredDot(match, self.eqns[j], c.operand, key))
        self.claimed[j] = comm.axis
    self._place(first, i, AgFusion(
        match, v, specs[comm.operand], (), comm.dim, deqn, comm.operand,
        (specs[1 - comm.operand], specs[2], gathered_spec), tuple(sorted(comm.summed)), key,
        mesh, self._cmesh_for(mesh),
        views and (views[comm.operand], views[1 - comm.operand])))
    return True

  # -- scatters ---------------------------------------------------------------------

  def _scatter(self, ri, reqn) -> bool:
    """matmul(s) with contracting dims sharded on a -> [layout ops] -> reshard adding a."""
    change = reshard_change(reqn)
    if change is None or change[0] != "scatter":
      return False
    _, axis, dim = change
    mesh = mesh_of(reqn.invars[0])
    n = mesh.shape[axis]
    v, chain = reqn.invars[0], []
    while v in self.producer and self.eqns[self.producer[v]].primitive.name in LAYOUT_PRIMITIVES:
      if len(self.uses[v]) != 1 or v in self.outvars:
        return False
      chain.insert(0, self.eqns[self.producer[v]])
      v = chain[0].invars[0]
    if v not in self.producer or len(self.uses[v]) != 1 or v in self.outvars:
      return False
    # The terms of a sum of matmuls (the transpose of a gather feeding several).
    terms, sums, stack = [], [], [v]
    while stack:
      u = stack.pop()
      prod = self.eqns[self.producer[u]] if u in self.producer else None
      if prod is not None and prod.primitive.name == "add_any" and (
          len(self.uses[u]) == 1 and u not in self.outvars):
        sums.append(self.producer[u])
        stack.extend(reversed(prod.invars))
      else:
        terms.append(u)
    dots = [self.eqns[self.producer[u]] for u in terms if u in self.producer
            and self.eqns[self.producer[u]].primitive.name == "dot_general"]
    comms = [self._comm(d) for d in dots]
    if not any(c is not None and axis in c.summed for c in comms):
      return False  # no matmul whose partial sums over the axis this reshard scatters
    # The scattered dim, traced back from the reshard to the product.
    dims, d = [], dim
    for ceqn in reversed(chain):
      dims.insert(0, d)
      d = dim_through(ceqn, d, n, forward=False) if d is not None else None
    c0 = comms[0]
    summed = c0.summed - {axis} if c0 is not None and c0.kind == "local" else frozenset()
    fused_gather = next((self.claimed[j] for j in map(self.eqns.index, dots)
                         if j in self.claimed), None)
    reason = (Reason("one_per_matmul", f"the matmul already fuses a gather over "
                     f"{fused_gather!r}") if fused_gather else
              Reason("sum_other_terms", "the reduce-scattered value sums matmuls with other "
                     "terms") if len(dots) != len(terms) else self._sum_reason(dots, comms, axis))
    return self._fuse_rs(ri, dots, axis, d, dim, list(zip(chain, dims)), reqn, summed,
                         sums=sums, reason=reason)

  def _fuse_rs(self, at, dots, axis, dim, collective_dim, chain, source_eqn, summed, *,
               sums=(), reason=None) -> bool:
    """Plan one matmul_rs at equation `at` for `dots` (summed) whose product's `dim` is
    scattered over `axis`, then `chain`, giving `source_eqn`'s result."""
    deqn = dots[0]
    mesh = mesh_of(deqn.outvars[0])
    n = mesh.shape[axis]
    specs = [spec_of(v) for v in (*deqn.invars, deqn.outvars[0])]
    dd = DotDims(deqn.params["dimension_numbers"], *(v.aval.ndim for v in deqn.invars))
    pair = next(((i, j) for i, j in zip(dd.lc, dd.rc) if axis in specs[0][i]), None)
    k = len(dots)
    shapes = [list(local_shape(v, s, mesh)) for v, s in zip((*deqn.invars, deqn.outvars[0]), specs)]
    if k > 1 and pair is not None:  # the concatenated operands
      shapes[0][pair[0]] *= k
      shapes[1][pair[1]] *= k
    if dim is not None:  # the product before the scatter, as in a shard_map body
      shapes[2] = list(local_shape(deqn.outvars[0], drop(specs[2], dim) if specs[2][dim] == (
          axis,) else specs[2], mesh))
    shapes = [tuple(s) for s in shapes]
    base = self._base("matmul_rs", axis, n, collective_dim, deqn, shapes, source_eqn)
    nb, nlf = len(dd.lb), len(dd.lf)
    if dim is not None:
      base.update(dim_kind="batch" if dim < nb else "free",
                  operand=None if dim < nb else "lhs" if dim < nb + nlf else "rhs")
    views, fp8_reason = self._fp8(deqn)
    if (views or fp8_reason) and k > 1:
      views, fp8_reason = None, Reason("sum_not_mergeable", "a sum of fp8 matmuls, each with its "
                                       "own scales, is not one GEMM")
    self._dtype(base, views)
    reason = reason or (
        Reason("layout_splits_dim", "a layout op between matmul and reduce-scatter splits the "
               "scattered dim") if dim is None else
        Reason("batch_dim", "scattered dim is a batch dim of the matmul") if dim < nb else
        fp8_reason or (None if views else dtype_reason(deqn)))
    if reason:
      self._record(Match(status="skipped", reason=reason, **base))
      return False
    operand, op_dim = (0, dd.lf[dim - nb]) if dim < nb + nlf else (1, dd.rf[dim - nb - nlf])
    impl = self._impl("matmul_rs", deqn, shapes, operand, op_dim, n, mesh, views)
    if k > 1:
      impl = Reason(impl.code, f"{impl}; {k} summed matmuls as one GEMM over concatenated "
                    "contracting dims")
    match = Match(status=status_of(impl), reason="", impl=impl, **base)
    self._record(match)
    indices = [self.eqns.index(d) for d in dots]
    self._skip(*indices, *sums, *(self.eqns.index(c) for c, _ in chain))
    in_specs = tuple(spec_of(d.invars[0]) for d in dots) + tuple(spec_of(d.invars[1]) for d in dots)
    out_var = source_eqn.outvars[0]
    self._act(at, RsFusion(match, tuple(dots), pair or (None, None), dim, tuple(chain), in_specs,
                           out_var, spec_of(out_var), tuple(sorted(summed)), mesh,
                           self._cmesh_for(mesh), views))
    for i in indices:
      self.claimed[i] = axis
    return True

  def _sum_reason(self, dots, comms, axis):
    first, c0 = dots[0], comms[0]
    for d, c in zip(dots, comms):
      if c is None or c.kind != "local" or axis not in c.summed:
        return Reason("sum_not_mergeable", "a summed matmul does not sum partial products over "
                      "the axis")
      if c.summed != c0.summed:
        return Reason("sum_not_mergeable", "the summed matmuls all-reduce over different axes")
    if len(dots) == 1:
      return None
    dd = DotDims(first.params["dimension_numbers"], *(v.aval.ndim for v in first.invars))
    pair = next((i, j) for i, j in zip(dd.lc, dd.rc) if axis in spec_of(first.invars[0])[i])
    def key(d, skip):
      return tuple((s if i not in skip else None) for i, s in enumerate(d.aval.shape))
    for d in dots[1:]:
      same = (d.params == first.params and
              all(spec_of(a) == spec_of(b) and a.aval.dtype == b.aval.dtype
                  for a, b in zip((*d.invars, d.outvars[0]), (*first.invars, first.outvars[0])))
              and key(d.invars[0], {pair[0]}) == key(first.invars[0], {pair[0]})
              and key(d.invars[1], {pair[1]}) == key(first.invars[1], {pair[1]}))
      if not same:
        return Reason("sum_not_mergeable", "the summed matmuls differ in dimension numbers, "
                      "dtypes, shardings or non-contracting shapes: they cannot be one GEMM")
    return None
