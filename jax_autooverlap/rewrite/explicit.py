"""Collective matmuls of programs without shard_map: read from explicit-sharding types.

On meshes with Explicit axes every value's type says how it is sharded
(`f32[64@tp,32]`), so the collectives XLA will insert are visible in the jaxpr:

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

Each becomes the fused op (`ag_matmul` / `matmul_rs`) inside a `jax.shard_map`
manual over the mesh axes named in the types, with in/out specs read from
them: in the body every value is a local block, the op communicates over a,
and matmuls that also sum over other axes (data-parallel weight gradients)
`psum` over those.  A sum of k matmuls is one GEMM over their local operands
concatenated along a contracting dim.  Every candidate becomes a `Match`
(origin "explicit"); `survey` says what was looked at when nothing was found.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_autooverlap.ops.api import ag_matmul, matmul_rs
from jax_autooverlap.ops.planning import DotDims, describe
from jax_autooverlap.rewrite import _jax
from jax_autooverlap.rewrite.analysis import FUSABLE_DTYPES, SKIP
from jax_autooverlap.rewrite.layout import LAYOUT_PRIMITIVES, dim_through
from jax_autooverlap.rewrite.match import Match, status_of
from jax_autooverlap.runtime import context

ORIGIN = "explicit"


# --- sharding types --------------------------------------------------------------

def _entry(e) -> tuple:
  return () if e is None else (e,) if isinstance(e, str) else tuple(e)


def _spec(v):
  """Mesh axes sharding each dim of v's type, e.g. ((), ("tp",)); None if not usable."""
  sharding = getattr(v.aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
    return None
  parts = tuple(spec) + (None,) * (v.aval.ndim - len(spec))
  return tuple(_entry(e) for e in parts)


def _mesh(v):
  return getattr(getattr(v.aval, "sharding", None), "mesh", None)


def _drop(spec, d):
  return spec[:d] + ((),) + spec[d + 1:]


def _pspec(spec) -> P:
  return P(*(None if not e else e[0] if len(e) == 1 else e for e in spec))


def _local_shape(v, spec, mesh, split=None):
  """v's block per device when every axis of `spec` is manual; split=(dim, n): that dim is
  also divided by n (the shard of the fused collective's axis)."""
  shape = [size // math.prod(mesh.shape[a] for a in e) for size, e in zip(v.aval.shape, spec)]
  if split is not None:
    shape[split[0]] //= split[1]
  return tuple(shape)


def _sum_axes(dd: DotDims, lhs, rhs, out):
  """Axes whose partial sums a dot_general all-reduces when nothing else communicates.

  None when the dot needs more: the result is not what the operands' shardings
  give (JAX's rule: batch dims, then lhs free, then rhs free) or a contracting
  pair is sharded differently on its two sides.
  """
  summed = set()
  for i, j in zip(dd.lc, dd.rc):
    if lhs[i] != rhs[j]:
      return None
    summed.update(lhs[i])
  if any(lhs[i] != rhs[j] for i, j in zip(dd.lb, dd.rb)):
    return None
  want = tuple(lhs[i] for i in dd.lb) + tuple(lhs[i] for i in dd.lf) + tuple(rhs[i] for i in dd.rf)
  return frozenset(summed) if want == out else None


@dataclasses.dataclass(frozen=True)
class _Comm:
  """How one dot_general communicates: "local", "ag" (gathers operand's dim) or "rs"."""
  kind: str
  axis: str | None = None
  operand: int | None = None
  dim: int | None = None  # ag: the operand's gathered dim; rs: the product's scattered dim
  summed: frozenset = frozenset()  # other axes all-reduced (contracting dims sharded alike)


def _classify(dd: DotDims, lhs, rhs, out) -> _Comm | None:
  """What a dot_general with these operand/result shardings communicates (None: something
  this module does not fuse, e.g. two axes gathered at once)."""
  summed = _sum_axes(dd, lhs, rhs, out)
  if summed is not None:
    return _Comm("local", summed=summed)
  out_axes = {a for e in out for a in e}
  for x, spec in enumerate((lhs, rhs)):
    batch = dd.lb if x == 0 else dd.rb
    for d, e in enumerate(spec):
      # Only gathers the result needs: if it is replicated over the axis, XLA
      # may as well multiply the shards and gather the product.
      if len(e) != 1 or d in batch or e[0] not in out_axes:
        continue
      ops = [lhs, rhs]
      ops[x] = _drop(spec, d)
      summed = _sum_axes(dd, *ops, out)
      if summed is not None and e[0] not in summed:
        return _Comm("ag", e[0], x, d, summed)
  nb = len(dd.lb)
  for i, j in zip(dd.lc, dd.rc):
    if len(lhs[i]) == 1 and lhs[i] == rhs[j]:
      for od in range(nb, len(out)):
        if out[od] == lhs[i]:
          summed = _sum_axes(dd, _drop(lhs, i), _drop(rhs, j), _drop(out, od))
          if summed is not None:
            return _Comm("rs", lhs[i][0], dim=od, summed=summed)
  return None


def _reshard_change(eqn):
  """("gather"|"scatter", axis, dim) when a reshard takes one axis off / puts one on one dim."""
  src, dst = _spec(eqn.invars[0]), _spec(eqn.outvars[0])
  if src is None or dst is None or len(src) != len(dst) or _mesh(eqn.invars[0]) != _mesh(
      eqn.outvars[0]):
    return None
  diff = [d for d in range(len(src)) if src[d] != dst[d]]
  if len(diff) != 1:
    return None
  d = diff[0]
  # Only the minor-most axis of a dim: its blocks nest inside the others' blocks.
  if len(src[d]) == len(dst[d]) + 1 and src[d][:-1] == dst[d]:
    return "gather", src[d][-1], d
  if len(dst[d]) == len(src[d]) + 1 and dst[d][:-1] == src[d]:
    return "scatter", dst[d][-1], d
  return None


# --- actions the interpreter emits ---------------------------------------------------

class ExplicitAction:
  """What the interpreter runs instead of binding an equation of an explicit-sharding program."""

  def emit(self, interp, read, env):
    raise NotImplementedError


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


def _shard_map(body, mesh, cmesh, in_specs, out_specs, args):
  axes = {a for spec in (*in_specs, *out_specs) for e in spec for a in e}
  # check_vma=False: a result replicated over an axis its body varies on (a
  # gathered matmul with a replicated weight) is legal; shard_map's transpose
  # then sums cotangents over the axes an input is replicated on, as the
  # unfused program does.
  f = jax.shard_map(body, mesh=mesh, in_specs=tuple(map(_pspec, in_specs)),
                    out_specs=tuple(map(_pspec, out_specs)), axis_names=axes, check_vma=False)
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

  def reads(self):
    return (self.shard_var, self.dot_eqn.invars[1 - self.operand])

  def emit(self, interp, read, env):
    a, n, x = self.match.axis_name, self.match.axis_size, self.operand
    p = self.dot_eqn.params
    need = self.gathered_key is not None

    def body(shard, other):
      for ceqn, out_dim in self.chain:
        spec = _spec(ceqn.outvars[0])
        shard = _local_layout(ceqn, shard, _local_shape(ceqn.outvars[0], spec, self.mesh,
                                                        (out_dim, n)))
      lhs, rhs = (shard, other) if x == 0 else (other, shard)
      res = ag_matmul(lhs, rhs, a, gather_dim=self.gather_dim, gather_operand=x,
                      dimension_numbers=p["dimension_numbers"], precision=p["precision"],
                      preferred_element_type=p["preferred_element_type"],
                      return_gathered=need, config=interp.config)
      out, gathered = res if need else (res, None)
      if self.summed:
        out = lax.psum(out, self.summed)
      return (out, gathered) if need else (out,)

    other_spec, out_spec, gathered_spec = self.specs
    outs = _shard_map(body, self.mesh, self.cmesh, (self.shard_spec, other_spec),
                      (out_spec, gathered_spec) if need else (out_spec,),
                      (read(self.shard_var), read(self.dot_eqn.invars[1 - x])))
    env[self.dot_eqn.outvars[0]] = outs[0]
    if need:
      env[self.gathered_key] = outs[1]


def _producers_first(fusions):
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
  dot_eqn: Any
  operand: int
  gathered_key: Any

  def emit(self, interp, read, env):
    args = [read(v) for v in self.dot_eqn.invars]
    args[self.operand] = env[self.gathered_key]
    env[self.dot_eqn.outvars[0]] = self.dot_eqn.primitive.bind(*args, **self.dot_eqn.params)


@dataclasses.dataclass(eq=False)
class _Bind(ExplicitAction):
  """The equation itself, bound as written."""
  eqn: Any

  def emit(self, interp, read, env):
    outs = self.eqn.primitive.bind(*(read(v) for v in self.eqn.invars), **self.eqn.params)
    outs = outs if self.eqn.primitive.multiple_results else [outs]
    env.update(zip(self.eqn.outvars, outs))


@dataclasses.dataclass(eq=False)
class _Then(ExplicitAction):
  """Several actions at one equation: fused ops placed ahead of a matmul that reads their
  gathered value, then the equation's own action."""
  actions: tuple

  def emit(self, interp, read, env):
    for action in self.actions:
      action.emit(interp, read, env)


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

  def emit(self, interp, read, env):
    a, n, k = self.match.axis_name, self.match.axis_size, len(self.dots)
    p = self.dots[0].params

    def body(*ops):
      lhs, rhs = ops[:k], ops[k:]
      x = lhs[0] if k == 1 else lax.concatenate(lhs, self.concat[0])
      w = rhs[0] if k == 1 else lax.concatenate(rhs, self.concat[1])
      y = matmul_rs(x, w, a, scatter_dim=self.scatter_dim,
                    dimension_numbers=p["dimension_numbers"], precision=p["precision"],
                    preferred_element_type=p["preferred_element_type"], config=interp.config)
      if self.summed:
        y = lax.psum(y, self.summed)
      for ceqn, out_dim in self.chain:
        spec = _spec(ceqn.outvars[0])
        y = _local_layout(ceqn, y, _local_shape(ceqn.outvars[0], spec, self.mesh, (out_dim, n)))
      return (y,)

    args = [read(d.invars[0]) for d in self.dots] + [read(d.invars[1]) for d in self.dots]
    env[self.out_var] = _shard_map(body, self.mesh, self.cmesh, self.in_specs,
                                   (self.out_spec,), args)[0]


# --- matching -----------------------------------------------------------------------

def match(plan, config, jaxpr, path: str) -> bool:
  """Plan the fused ops of one jaxpr outside shard_map; True if any was planned."""
  return _Matcher(plan, config, jaxpr, path).run()


@dataclasses.dataclass
class _Gather:
  """A reshard gathering `axis` off dim `dim` of `shard`, then layout ops, into dots."""
  index: int
  eqn: Any
  axis: str
  dim: int
  chain: list
  gather_dim: int | None
  broken: str | None
  value: Any  # the chain's end: what the dots consume
  dots: list
  nbytes: int


class _Matcher:

  def __init__(self, plan, config, jaxpr, path):
    self.plan, self.config, self.jaxpr, self.path = plan, config, jaxpr, path
    self.eqns = jaxpr.eqns
    self.uses = defaultdict(list)
    self.producer = {}
    for i, eqn in enumerate(self.eqns):
      for v in eqn.invars:
        if _jax.is_var(v):
          self.uses[v].append(i)
      for v in eqn.outvars:
        self.producer[v] = i
    self.outvars = {v for v in jaxpr.outvars if _jax.is_var(v)}
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
      rest = [] if own is SKIP else [_Bind(self.eqns[i])] if own is None else [own]
      self._act(i, _Then((*_producers_first(fusions), *rest)))
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
    specs = [_spec(v) for v in (*eqn.invars, eqn.outvars[0])]
    if any(s is None for s in specs):
      return None
    dd = DotDims(eqn.params["dimension_numbers"], *(v.aval.ndim for v in eqn.invars))
    return _classify(dd, *specs)

  def _cmesh_for(self, mesh):
    cmesh = self.cmesh
    return cmesh if cmesh is not None and cmesh.abstract_mesh == mesh else None

  def _available_at(self, eqn, i) -> bool:
    return all(self.producer.get(v, -1) < i for v in eqn.invars if _jax.is_var(v))

  def _base(self, kind, axis, n, collective_dim, deqn, shapes, source_eqn):
    return dict(kind=kind, axis_name=axis, axis_size=n, collective_dim=collective_dim,
                lhs_shape=shapes[0], rhs_shape=shapes[1], out_shape=shapes[2],
                dtype=str(deqn.outvars[0].aval.dtype), source=_jax.source_line(source_eqn),
                path=self.path, origin=ORIGIN)

  def _impl(self, kind, deqn, shapes, operand, dim, n, mesh):
    lhs, rhs = deqn.invars
    dtype = lhs.aval.dtype if lhs.aval.dtype == rhs.aval.dtype else None
    return describe(kind, shapes[0], shapes[1], operand, dim, deqn.params["dimension_numbers"],
                    n, dtype, deqn.outvars[0].aval.dtype, self.config, self._cmesh_for(mesh))

  @staticmethod
  def _dtype_reason(deqn):
    for what, v in (("lhs", deqn.invars[0]), ("rhs", deqn.invars[1]), ("result", deqn.outvars[0])):
      if str(v.aval.dtype) not in FUSABLE_DTYPES:
        return f"{what} dtype {v.aval.dtype} is not one of {FUSABLE_DTYPES}"
    return None

  # -- gathers ----------------------------------------------------------------------

  def _gather(self, i, eqn) -> _Gather | None:
    change = _reshard_change(eqn)
    if change is None or change[0] != "gather":
      return None
    _, axis, dim = change
    n = _mesh(eqn.invars[0]).shape[axis]
    v, chain, gdim, broken = eqn.outvars[0], [], dim, None
    while len(self.uses[v]) == 1 and v not in self.outvars:
      nxt = self.eqns[self.uses[v][0]]
      if nxt.primitive.name not in LAYOUT_PRIMITIVES:
        break
      new = dim_through(nxt, gdim, n, forward=True) if broken is None else None
      if _spec(nxt.outvars[0]) is None and broken is None:
        new, broken = None, f"layout op {nxt.primitive.name} has no usable sharding type"
      if new is None and broken is None:
        broken = f"layout op {nxt.primitive.name} between gather and matmul splits the gathered dim"
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
    mesh = _mesh(g.eqn.invars[0])
    n = mesh.shape[g.axis]
    x, dim_kind = self._gather_kind(di, g.value, g.gather_dim)
    comm = None if x is None else self._comm(deqn)
    specs = [_spec(v) for v in (*deqn.invars, deqn.outvars[0])]
    shapes = [_local_shape(v, s, mesh) if s is not None else tuple(v.aval.shape)
              for v, s in zip((*deqn.invars, deqn.outvars[0]), specs)]
    base = self._base("ag_matmul", g.axis, n, g.dim, deqn, shapes, g.eqn)
    base["n_dots"] = len(g.dots)
    if x is not None and g.gather_dim is not None:
      base.update(operand=("lhs", "rhs")[x], dim_kind=dim_kind)
    reason = (
        g.broken if g.broken else
        "the gathered value is both operands of the matmul" if x is None else
        "gathered dim is a batch dim of the matmul" if dim_kind == "batch" else
        f"the matmul's other operand, gathered over {self.claimed[di]!r} (a larger transfer), "
        "is fused into it instead; this gather runs first, unfused" if di in self.claimed else
        self._dtype_reason(deqn) or
        ("the gathered value is used before the matmul"
         if any(j < first for j in self.uses[g.value]) else None))
    if reason is None and (comm is None or comm.kind != "local" or g.axis in comm.summed):
      reason = ("the matmul communicates besides this gather (operand shardings "
                f"{_pspec(specs[0])} x {_pspec(specs[1])} -> {_pspec(specs[2])})")
    if reason:
      self._record(Match(status="skipped", reason=reason, **base))
      return False
    need = len(self.uses[g.value]) > 1 or g.value in self.outvars
    impl = self._impl("ag_matmul", deqn, shapes, x, g.gather_dim, n, mesh)
    match = Match(status=status_of(impl), reason="", impl=impl, **base)
    self._record(match)
    self._skip(g.index, *(self.eqns.index(c) for c, _ in g.chain))
    self._place(first, di, AgFusion(
        match, g.eqn.invars[0], _spec(g.eqn.invars[0]), tuple(g.chain), g.gather_dim, deqn, x,
        (specs[1 - x], specs[2], specs[x]), tuple(sorted(comm.summed)),
        g.value if need else None, mesh, self._cmesh_for(mesh)))
    return True

  def _fuse_implicit_gather(self, members) -> bool:
    """Dots that each gather the same value: one fused op, the others reuse its gathered value."""
    comms = dict(members)
    first, (v, dim) = members[0][0], (self.eqns[members[0][0]].invars[members[0][1].operand],
                                      members[0][1].dim)
    i = self._pick([j for j, _ in members], v, dim)
    comm, deqn = comms[i], self.eqns[i]
    mesh = _mesh(v)
    n = mesh.shape[comm.axis]
    specs = [_spec(u) for u in (*deqn.invars, deqn.outvars[0])]
    gathered_spec = _drop(specs[comm.operand], comm.dim)
    shapes = [_local_shape(u, s, mesh) for u, s in zip((*deqn.invars, deqn.outvars[0]), specs)]
    shapes[comm.operand] = _local_shape(v, gathered_spec, mesh)
    x, dim_kind = self._gather_kind(i, v, dim)
    base = self._base("ag_matmul", comm.axis, n, comm.dim, deqn, shapes, deqn)
    base["n_dots"] = len(members)
    if x is not None:
      base.update(operand=("lhs", "rhs")[x], dim_kind=dim_kind)
    reason = ("the gathered value is both operands of the matmul" if x is None else
              self._dtype_reason(deqn))
    if reason:
      self._record(Match(status="skipped", reason=reason, **base))
      return False
    impl = self._impl("ag_matmul", deqn, shapes, comm.operand, comm.dim, n, mesh)
    match = Match(status=status_of(impl), reason="", impl=impl, **base)
    self._record(match)
    key = object() if len(members) > 1 else None  # env key of the gathered value
    for j, c in members:
      if j != i:
        self._act(j, GatheredDot(self.eqns[j], c.operand, key))
        self.claimed[j] = comm.axis
    self._place(first, i, AgFusion(
        match, v, specs[comm.operand], (), comm.dim, deqn, comm.operand,
        (specs[1 - comm.operand], specs[2], gathered_spec), tuple(sorted(comm.summed)), key,
        mesh, self._cmesh_for(mesh)))
    return True

  # -- scatters ---------------------------------------------------------------------

  def _scatter(self, ri, reqn) -> bool:
    """matmul(s) with contracting dims sharded on a -> [layout ops] -> reshard adding a."""
    change = _reshard_change(reqn)
    if change is None or change[0] != "scatter":
      return False
    _, axis, dim = change
    mesh = _mesh(reqn.invars[0])
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
    reason = (f"the matmul already fuses a gather over {fused_gather!r}" if fused_gather else
              "the reduce-scattered value sums matmuls with other terms"
              if len(dots) != len(terms) else self._sum_reason(dots, comms, axis))
    return self._fuse_rs(ri, dots, axis, d, dim, list(zip(chain, dims)), reqn, summed,
                         sums=sums, reason=reason)

  def _fuse_rs(self, at, dots, axis, dim, collective_dim, chain, source_eqn, summed, *,
               sums=(), reason=None) -> bool:
    """Plan one matmul_rs at equation `at` for `dots` (summed) whose product's `dim` is
    scattered over `axis`, then `chain`, giving `source_eqn`'s result."""
    deqn = dots[0]
    mesh = _mesh(deqn.outvars[0])
    n = mesh.shape[axis]
    specs = [_spec(v) for v in (*deqn.invars, deqn.outvars[0])]
    dd = DotDims(deqn.params["dimension_numbers"], *(v.aval.ndim for v in deqn.invars))
    pair = next(((i, j) for i, j in zip(dd.lc, dd.rc) if axis in specs[0][i]), None)
    k = len(dots)
    shapes = [list(_local_shape(v, s, mesh)) for v, s in zip((*deqn.invars, deqn.outvars[0]), specs)]
    if k > 1 and pair is not None:  # the concatenated operands
      shapes[0][pair[0]] *= k
      shapes[1][pair[1]] *= k
    if dim is not None:  # the product before the scatter, as in a shard_map body
      shapes[2] = list(_local_shape(deqn.outvars[0], _drop(specs[2], dim) if specs[2][dim] == (
          axis,) else specs[2], mesh))
    shapes = [tuple(s) for s in shapes]
    base = self._base("matmul_rs", axis, n, collective_dim, deqn, shapes, source_eqn)
    nb, nlf = len(dd.lb), len(dd.lf)
    if dim is not None:
      base.update(dim_kind="batch" if dim < nb else "free",
                  operand=None if dim < nb else "lhs" if dim < nb + nlf else "rhs")
    reason = reason or (
        "a layout op between matmul and reduce-scatter splits the scattered dim" if dim is None
        else "scattered dim is a batch dim of the matmul" if dim < nb else
        self._dtype_reason(deqn))
    if reason:
      self._record(Match(status="skipped", reason=reason, **base))
      return False
    operand, op_dim = (0, dd.lf[dim - nb]) if dim < nb + nlf else (1, dd.rf[dim - nb - nlf])
    impl = self._impl("matmul_rs", deqn, shapes, operand, op_dim, n, mesh)
    if k > 1:
      impl += f"; {k} summed matmuls as one GEMM over concatenated contracting dims"
    match = Match(status=status_of(impl), reason="", impl=impl, **base)
    self._record(match)
    indices = [self.eqns.index(d) for d in dots]
    self._skip(*indices, *sums, *(self.eqns.index(c) for c, _ in chain))
    in_specs = tuple(_spec(d.invars[0]) for d in dots) + tuple(_spec(d.invars[1]) for d in dots)
    out_var = source_eqn.outvars[0]
    self._act(at, RsFusion(match, tuple(dots), pair or (None, None), dim, tuple(chain), in_specs,
                           out_var, _spec(out_var), tuple(sorted(summed)), mesh,
                           self._cmesh_for(mesh)))
    for i in indices:
      self.claimed[i] = axis
    return True

  def _sum_reason(self, dots, comms, axis):
    first, c0 = dots[0], comms[0]
    for d, c in zip(dots, comms):
      if c is None or c.kind != "local" or axis not in c.summed:
        return "a summed matmul does not sum partial products over the axis"
      if c.summed != c0.summed:
        return "the summed matmuls all-reduce over different axes"
    if len(dots) == 1:
      return None
    dd = DotDims(first.params["dimension_numbers"], *(v.aval.ndim for v in first.invars))
    pair = next((i, j) for i, j in zip(dd.lc, dd.rc) if axis in _spec(first.invars[0])[i])
    def key(d, skip):
      return tuple((s if i not in skip else None) for i, s in enumerate(d.aval.shape))
    for d in dots[1:]:
      same = (d.params == first.params and
              all(_spec(a) == _spec(b) and a.aval.dtype == b.aval.dtype
                  for a, b in zip((*d.invars, d.outvars[0]), (*first.invars, first.outvars[0])))
              and key(d.invars[0], {pair[0]}) == key(first.invars[0], {pair[0]})
              and key(d.invars[1], {pair[1]}) == key(first.invars[1], {pair[1]}))
      if not same:
        return ("the summed matmuls differ in dimension numbers, dtypes, shardings or "
                "non-contracting shapes: they cannot be one GEMM")
    return None


# --- what was looked at, when nothing was found --------------------------------------

_COLLECTIVES = ("all_gather", "reduce_scatter", "psum", "psum_invariant", "all_to_all",
                "ppermute")


def survey(closed_jaxpr) -> list[str]:
  """What the analysis looked at, and what to change, for a program with no candidate."""
  seen = {"dots": 0, "smaps": 0, "collectives": 0}
  axes: dict[str, str] = {}

  def note_mesh(mesh):
    for name, kind in zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())):
      axes.setdefault(name, f"{name}={mesh.shape[name]} {getattr(kind, 'name', kind)}")

  def walk(jaxpr, manual):
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if name == "shard_map":
        seen["smaps"] += 1
        note_mesh(eqn.params.get("mesh"))
      elif manual and name in _COLLECTIVES:
        seen["collectives"] += 1
      elif not manual and name == "dot_general":
        seen["dots"] += 1
        for v in eqn.invars:
          note_mesh(_mesh(v))
      for sub in _jax.sub_jaxprs(eqn.params):
        walk(sub, manual or name == "shard_map")

  walk(closed_jaxpr.jaxpr, False)
  note_mesh(jax.sharding.get_abstract_mesh())
  kinds = " ".join(axes.values())
  looked = (f"looked at {seen['dots']} dot_general(s) outside shard_map (mesh axes: "
            f"{', '.join(axes.values()) or 'none'}) and {seen['smaps']} shard_map bodies "
            f"({seen['collectives']} collectives inside)")
  notes = [looked, "no shard_map or explicit-sharding collective found next to a matmul"]
  if "Explicit" in kinds and "Auto" not in kinds:
    notes.append("the Explicit axes' shardings imply no all-gather or reduce-scatter next to a "
                 "matmul: a gather is `reshard(x, P(...))` taking an axis off a dim that feeds "
                 "a matmul; a reduce-scatter is a matmul over a contracting dim sharded on an "
                 "axis with `out_sharding` sharding a free dim on it")
  else:
    notes.append("collectives here are inserted by XLA's partitioner; use explicit axes "
                 "(jax.make_mesh(..., axis_types=Explicit)) or shard_map")
  if seen["collectives"]:
    notes.append("inside shard_map, fused are tiled all_gather -> dot_general and dot_general "
                 "-> tiled psum_scatter (through reshapes, transposes, casts)")
  return notes
