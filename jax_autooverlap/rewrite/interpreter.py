"""Re-emit a traced program with the planned fused ops in place.

An interpreter in the style of `jax.core.eval_jaxpr`: equations are bound one
by one under the caller's trace, except where the plan says otherwise.
Higher-order equations whose bodies contain fused ops are rebuilt through a
rule registry keyed by primitive name: shard_map re-enters `jax.shard_map`
(so axis names and varying-axis types are set up by JAX itself); every other
primitive gets its sub-jaxprs re-traced from this interpreter and is bound
with otherwise identical params.

Whatever goes wrong while emitting one fused op (or rebuilding one
higher-order equation) never breaks the program: the equations it stands for
are bound as written, the match is reported as skipped with the error, and the
rest of the program is still rewritten.
"""
from __future__ import annotations

import warnings
from typing import Callable

import jax
from jax import lax

from jax_autooverlap._compat import vary_over, varying_axes
from jax_autooverlap.ops import ag_matmul, matmul_rs
from jax_autooverlap.reasons import Reason
from jax_autooverlap.rewrite import _jax, fp8, summed
from jax_autooverlap.rewrite.plan import (SKIP, AgPlan, AmaxPlan, ExplicitAction, Fp8AgPlan, Plan,
                                          RsPlan)
from jax_autooverlap.rewrite.layout import apply_to_shard
from jax_autooverlap.runtime import context
from jax_autooverlap.tuning.config import OverlapConfig


class RewriteError(RuntimeError):
  """The rewrite could not rebuild a program it had planned to change."""


Rule = Callable[["Interpreter", object, list], list]
RULES: dict[str, Rule] = {}


def register_rule(name: str):
  def deco(fn):
    RULES[name] = fn
    return fn
  return deco


class Interpreter:

  def __init__(self, plan: Plan, config: OverlapConfig):
    self.plan = plan
    self.config = config

  def eval(self, jaxpr, consts, args) -> list:
    env = {}

    producers = {}

    def read(v):
      return v.val if isinstance(v, _jax.Literal) else env[v]

    def value(v):
      """read(v), computing it first where a fused op needs it early (see analysis)."""
      if isinstance(v, _jax.Literal) or v in env:
        return read(v)
      if not producers:
        producers.update(_jax.dataflow(jaxpr)[1])
      eqn = jaxpr.eqns[producers[v]]
      with _jax.eqn_context(eqn):
        outs = _bind(eqn, eqn.params, [value(x) for x in eqn.invars])
      env.update(zip(eqn.outvars, outs))
      return env[v]

    for v, x in zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *args)):
      env[v] = x
    key = id(jaxpr)
    for i, eqn in enumerate(jaxpr.eqns):
      for plan in self.plan.emit_before.get((key, i), ()):
        self._emit(plan, value, env)
      action = self.plan.actions.get((key, i))
      if action is SKIP:
        continue
      if isinstance(action, (AgPlan, RsPlan, Fp8AgPlan, AmaxPlan)):
        self._emit(action, value, env)
        continue
      if isinstance(action, ExplicitAction):  # programs without shard_map: rewrite/explicit/
        with _jax.eqn_context(eqn):
          self._emit_explicit(action, value, env)
        continue
      if eqn.outvars and all(v in env for v in eqn.outvars):
        continue  # computed early for a fused op
      invals = [read(v) for v in eqn.invars]
      with _jax.eqn_context(eqn):
        if (key, i) in self.plan.inline:  # a custom_jvp/vjp call whose body is its value
          body = eqn.params["call_jaxpr"]
          outs = self.eval(body.jaxpr, body.consts, invals)
        elif (key, i) in self.plan.rebuild:
          outs = self._rebuild(eqn, invals, (key, i))
        else:
          outs = _bind(eqn, eqn.params, invals)
      for v, x in zip(eqn.outvars, outs):
        env[v] = x
    return [read(v) for v in jaxpr.outvars]

  def _emit(self, plan, read, env):
    """Emit one fused op; if that fails, bind the equations it stands for."""
    emit, eqn = {AgPlan: (self._emit_ag, "dot_eqn"), RsPlan: (self._emit_rs, "rs_eqn"),
                 Fp8AgPlan: (self._emit_fp8_ag, "dot_eqn"),
                 AmaxPlan: (self._emit_amax, "reduce_eqn")}[type(plan)]
    try:
      with _jax.eqn_context(getattr(plan, eqn)):
        emit(plan, read, env)
    except Exception as e:  # noqa: BLE001 - any failure keeps this match unfused
      self._keep_unfused([plan.match], e, "rewriting this match")
      for eqn in plan.replaced:
        with _jax.eqn_context(eqn):
          outs = _bind(eqn, eqn.params, [read(v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, outs):
          env[v] = x

  def _emit_explicit(self, action: ExplicitAction, value, env):
    """Emit each part of an explicit-sharding action; a part that fails keeps its matches
    unfused: what it writes is computed as the program does."""
    for part in action.parts():
      try:
        part.emit(self, value, env)
      except Exception as e:  # noqa: BLE001 - any failure keeps this match unfused
        if not part.matches:
          raise  # an equation of the program itself, bound as written
        self._keep_unfused(part.matches, e, "rewriting this match")
        for v in part.writes():
          env.pop(v, None)
          env[v] = value(v)

  def _rebuild(self, eqn, invals, key):
    rule = RULES.get(eqn.primitive.name, _generic_rule)
    try:
      return rule(self, eqn, invals)
    except Exception as e:  # noqa: BLE001 - keep the equation as written
      self._keep_unfused(self.plan.inside.get(key, ()), e, f"rebuilding {eqn.primitive.name}")
      return _bind(eqn, eqn.params, invals)

  def _keep_unfused(self, matches, error, what):
    text = str(error).strip().splitlines()
    reason = Reason("internal_error", f"internal error while {what}, kept unfused: "
                    f"{type(error).__name__}: {text[0][:300] if text else ''}")
    for m in matches:
      if m.rewritten and self.plan.report.mark_skipped(m, reason):
        warnings.warn(f"jax_autooverlap: {m.kind} over {m.axis_name!r} at {m.source}: {reason}",
                      RuntimeWarning, stacklevel=2)

  def _emit_ag(self, a: AgPlan, read, env):
    n = a.match.axis_size or 1
    shard = read(a.gather_eqn.invars[0])
    for ceqn, out_dim in a.chain:
      shard = apply_to_shard(ceqn, shard, out_dim, n)
    other = read(a.dot_eqn.invars[1 - a.operand])
    x, w = (shard, other) if a.operand == 0 else (other, shard)
    p = a.dot_eqn.params
    res = ag_matmul(x, w, a.match.axis_name, gather_dim=a.gather_dim, gather_operand=a.operand,
                    dimension_numbers=p["dimension_numbers"], precision=p["precision"],
                    preferred_element_type=p["preferred_element_type"],
                    return_gathered=a.need_gathered, config=self.config)
    out, gathered = res if a.need_gathered else (res, None)
    env[a.dot_eqn.outvars[0]] = out
    if a.need_gathered:
      env[a.result_var] = gathered

  def _emit_fp8_ag(self, a: Fp8AgPlan, read, env):
    n = a.match.axis_size or 1
    shard = read(a.shard_var)
    for kind, op, out_dim in a.shard_ops:
      if kind == "elementwise":
        shard = op.apply(shard, read)
      elif kind == "move":
        shard = fp8.rebind(op, shard)
      else:
        shard = apply_to_shard(op, shard, out_dim, n)
    other = fp8.read_moved(a.other, read)
    x, w = (shard, other) if a.operand == 0 else (other, shard)
    p = a.dot_eqn.params
    need = a.gathered_var is not None
    res = ag_matmul(x, w, a.match.axis_name, gather_dim=a.gather_dim, gather_operand=a.operand,
                    dimension_numbers=p["dimension_numbers"], precision=p["precision"],
                    preferred_element_type=a.dot_eqn.outvars[0].aval.dtype,
                    scales=(fp8.scale_of(a.factors, read, shard), None), return_gathered=need,
                    config=self.config)
    out, gathered = res if need else (res, None)
    env[a.dot_eqn.outvars[0]] = out
    if need:
      env[a.gathered_var] = gathered

  def _emit_amax(self, a: AmaxPlan, read, env):
    x = read(a.shard_var)
    local = a.reduce_eqn.primitive.bind(lax.abs(x), **a.reduce_eqn.params)
    # varying like the program's amax of the (varying) gathered value
    env[a.reduce_eqn.outvars[0]] = vary_over(lax.pmax(local, a.axis_name), varying_axes(x))

  def _emit_rs(self, r: RsPlan, read, env):
    n = r.match.axis_size or 1
    p = r.dot_eqn.params
    dots = r.dots or (r.dot_eqn,)
    if r.fp8 is not None:
      lhs, rhs, factors = r.fp8
      x, w = fp8.read_moved(lhs, read), fp8.read_moved(rhs, read)
      y = matmul_rs(x, w, r.match.axis_name, scatter_dim=r.scatter_dim,
                    dimension_numbers=p["dimension_numbers"], precision=p["precision"],
                    preferred_element_type=r.dot_eqn.outvars[0].aval.dtype,
                    scales=(fp8.scale_of(factors, read, x), None), config=self.config)
      self._finish_rs(r, y, n, env)
      return
    if len(dots) > 1:
      x, w, dn = summed.merge(dots, [(read(e.invars[0]), read(e.invars[1])) for e in dots])
    else:
      x, w, dn = read(r.dot_eqn.invars[0]), read(r.dot_eqn.invars[1]), p["dimension_numbers"]
    y = matmul_rs(x, w, r.match.axis_name, scatter_dim=r.scatter_dim, dimension_numbers=dn,
                  precision=p["precision"], preferred_element_type=p["preferred_element_type"],
                  config=self.config)
    self._finish_rs(r, y, n, env)

  def _finish_rs(self, r: RsPlan, y, n, env):
    """The scattered product through the layout ops after the matmul, into the result."""
    for ceqn, out_dim in r.chain:
      y = apply_to_shard(ceqn, y, out_dim, n)
    out_shape = r.rs_eqn.outvars[0].aval.shape
    if y.shape != out_shape:  # an untiled psum_scatter: its reshape split the scattered axis off
      y = y.reshape(out_shape)
    env[r.rs_eqn.outvars[0]] = y

  def retrace(self, j):
    """Re-trace a (Closed)Jaxpr through this interpreter; same type and signature."""
    closed = j if isinstance(j, _jax.ClosedJaxpr) else _jax.ClosedJaxpr(j, [])
    fun = lambda *args: self.eval(closed.jaxpr, closed.consts, args)
    new = jax.make_jaxpr(fun)(*(v.aval for v in closed.jaxpr.invars))
    if isinstance(j, _jax.ClosedJaxpr):
      return new
    if new.consts:
      raise RewriteError(f"rewritten body of an open jaxpr captured {len(new.consts)} constants")
    return new.jaxpr


def _bind(eqn, params, invals):
  bind_params = eqn.primitive.get_bind_params(params)
  subfuns = ()
  if isinstance(bind_params, tuple):  # jax < 0.9 returned (subfuns, params)
    subfuns, bind_params = bind_params
  outs = eqn.primitive.bind(*subfuns, *invals, **bind_params)
  return outs if eqn.primitive.multiple_results else [outs]


def _generic_rule(interp: Interpreter, eqn, invals):
  """Any higher-order primitive: same params, rewritten sub-jaxprs."""
  return _bind(eqn, _jax.map_jaxprs(eqn.params, interp.retrace), invals)


@register_rule("shard_map")
def _shard_map_rule(interp: Interpreter, eqn, invals):
  p = eqn.params
  body = p["jaxpr"]
  fn = lambda *args: tuple(interp.eval(body, (), args))
  smap = jax.shard_map(fn, mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                       out_specs=tuple(p["out_specs"]), axis_names=set(p["newly_manual_axes"]),
                       check_vma=p["check_vma"])
  with context.use_mesh(p["mesh"]):
    return list(smap(*invals))
