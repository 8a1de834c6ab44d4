"""Before matching: the custom_jvp / custom_vjp calls of fp8 code replaced by their bodies.

Flax's fp8 ops (flax.linen.fp8_ops: in_q, in_qdq, quantized_dot, out_dq) wrap the
quantization, the fp8 dot_general and the dequantization in custom_vjp functions, so in a
traced program the gathered value enters a call and the matmul's result leaves another: no
collective is next to a matmul.  A region the rewrite emits is only evaluated (ao.jit's
primal, forward and backward programs are each the value of a custom_vjp rule, never
differentiated themselves), so a call may be replaced by its body, as XLA's lowering does
anyway.  Only programs that touch an fp8 dtype have their calls inlined (out_dq's body,
which scales the fp8 matmul's result, has no fp8 value itself); others are traced as they
are.
"""
from __future__ import annotations

from jax_autooverlap import fp8 as formats
from jax_autooverlap.rewrite import _jax
from jax_autooverlap.rewrite.interpreter import Interpreter
from jax_autooverlap.rewrite.plan import Plan
from jax_autooverlap.tuning.config import OverlapConfig

CUSTOM_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call"})


def _touches_fp8(jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if any(formats.is_fp8(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars)
           if hasattr(v.aval, "dtype")):
      return True
    if any(_touches_fp8(sub) for sub in _jax.sub_jaxprs(eqn.params)):
      return True
  return False


def _mark(jaxpr, plan: Plan) -> bool:
  """Mark custom calls to inline and the equations holding them to rebuild; True if any."""
  found = False
  for i, eqn in enumerate(jaxpr.eqns):
    key = (id(jaxpr), i)
    if eqn.primitive.name in CUSTOM_CALLS:
      plan.inline.add(key)
      _mark(eqn.params["call_jaxpr"].jaxpr, plan)
      found = True
    elif any([_mark(sub, plan) for sub in _jax.sub_jaxprs(eqn.params)]):
      plan.rebuild.add(key)
      found = True
  return found


def inline_fp8_calls(closed):
  """The closed jaxpr of a program that touches fp8 with its custom_jvp/custom_vjp calls
  inlined (itself if it has none, or no fp8)."""
  plan = Plan()
  if not _touches_fp8(closed.jaxpr) or not _mark(closed.jaxpr, plan):
    return closed
  return Interpreter(plan, OverlapConfig()).retrace(closed)
