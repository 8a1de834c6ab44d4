"""What the rewrite will do to a traced program: the plan the matchers write and the
interpreter reads, and the checks both matchers share.

The plan says, per (id(jaxpr), equation index), what the interpreter does
instead of binding the equation as written: skip it (`SKIP`: another
action computes its result), emit a fused op (`AgPlan`, `RsPlan` for
shard_map bodies; an `ExplicitAction` for programs without shard_map), or
rebuild a higher-order equation whose sub-jaxprs hold fused ops.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jax_autooverlap.reasons import Reason
from jax_autooverlap.rewrite.match import Match, Report

FUSABLE_DTYPES = ("float16", "bfloat16", "float32", "float64")
SKIP = "skip"


@dataclasses.dataclass(frozen=True)
class AgPlan:
  """An all_gather fused into one of the matmuls it feeds.

  Emitted before the first use of the gathered value, so that every other use
  (matmuls reusing it, anything else) sees it in program order.
  """
  match: Match
  gather_eqn: Any
  chain: tuple  # ((eqn, out_dim), ...) applied to the shard before the fused op
  gather_dim: int  # dim of the dot operand (after the chain) that is gathered
  dot_eqn: Any
  operand: int
  result_var: Any  # the chain's end: the gathered value the dots consume
  need_gathered: bool
  replaced: tuple = ()  # the equations it stands for, in program order (bound if it fails)


@dataclasses.dataclass(frozen=True)
class RsPlan:
  """A psum_scatter of one matmul, or of a sum of matmuls, as one fused GEMM+RS."""
  match: Match
  dot_eqn: Any  # the (first) matmul
  scatter_dim: int  # dim of the dot output that is scattered
  chain: tuple  # ((eqn, out_dim), ...) applied to the scattered result
  rs_eqn: Any
  dots: tuple = ()  # every summed matmul, in program order
  replaced: tuple = ()  # the equations it stands for, in program order (bound if it fails)
  fp8: tuple | None = None  # fp8 matmul: (fp8.Dequantized lhs, rhs, fp8.Factor of both and
                            # of scalings between the matmul and the scatter)


@dataclasses.dataclass(frozen=True)
class Fp8AgPlan:
  """An all_gather and a matmul reading it as fp8 (rewrite/fp8.py's forms), as one fp8
  ag_matmul: the shard is quantized (or its fp8 source taken) and gathered as fp8 bytes.

  Emitted at `at` (the first use of what it computes); the program's own equations it makes
  dead are skipped (`replaced`, bound as written if emitting fails), the others stay (XLA
  drops those whose results end up unused).
  """
  match: Match
  shard_var: Any  # what shard_ops start from: the gather's input, or the fp8 source
  shard_ops: tuple  # (kind, eqn or fp8.ElementwiseOp, out dim): "elementwise" | "move" (as
                    # written) | "gathered" (a layout op after the gather, on the shard)
  gather_dim: int  # dim of the matmul operand that is gathered
  dot_eqn: Any
  operand: int
  other: Any  # fp8.Dequantized: the other operand
  factors: tuple  # fp8.Factor of both operands
  gathered_var: Any  # the program's gathered fp8 value, given by the fused op too; or None
  replaced: tuple = ()


@dataclasses.dataclass(frozen=True)
class AmaxPlan:
  """`reduce_max(abs(all_gather(x)))` as the max over the group of the shards' amaxes."""
  match: Match
  shard_var: Any
  axis_name: Any
  reduce_eqn: Any
  replaced: tuple = ()


class ExplicitAction:
  """What the interpreter runs instead of binding an equation of a program without shard_map
  (rewrite/explicit/actions.py): emit(interp, read, env) writes the values `writes()` names.

  If emitting a part fails, the interpreter reports its `matches` skipped and computes what
  it writes as the program does (the equations it stands for, bound as written).
  """

  @property
  def matches(self) -> tuple:
    return ()

  def parts(self) -> tuple:
    """The actions that succeed or fail on their own (a composite lists its members)."""
    return (self,)

  def writes(self) -> tuple:
    """The program's variables this action computes."""
    return ()

  def emit(self, interp, read, env):
    raise NotImplementedError


@dataclasses.dataclass
class Plan:
  actions: dict = dataclasses.field(default_factory=dict)  # (id(jaxpr), i) -> SKIP | AgPlan | ...
  emit_before: dict = dataclasses.field(default_factory=dict)  # (id(jaxpr), i) -> [AgPlan]
  rebuild: set = dataclasses.field(default_factory=set)    # (id(jaxpr), i) of eqns to re-trace
  inside: dict = dataclasses.field(default_factory=dict)   # rebuilt (id(jaxpr), i) -> its matches
  inline: set = dataclasses.field(default_factory=set)  # custom_jvp/vjp calls bound as their body
  report: Report = dataclasses.field(default_factory=Report)

  @property
  def has_fused(self) -> bool:
    """Does the program change: is any of its own matches rewritten (status fused or unfused;
    rows of ao.jit regions inside it are already rewritten)?"""
    return any(m.rewritten and not m.function for m in self.report.matches)


def dtype_reason(dot_eqn, gathered: int | None = None) -> Reason | None:
  """Which operand (or the result) of a matmul has a dtype the fused ops do not take.

  `gathered`: the operand a fused gather feeds (named "gathered"/"other" in the message).
  """
  for j, side in enumerate(("lhs", "rhs")):
    dtype = str(dot_eqn.invars[j].aval.dtype)
    if dtype not in FUSABLE_DTYPES:
      role = "gathered" if gathered == j else "other" if gathered is not None else "matmul"
      return Reason("dtype", f"{role} operand ({side}) has dtype {dtype}; the fused ops take "
                    f"floating-point operands ({', '.join(FUSABLE_DTYPES)})")
  out = str(dot_eqn.outvars[0].aval.dtype)
  if out not in FUSABLE_DTYPES:
    return Reason("dtype", f"the matmul's result has dtype {out}, not one of {FUSABLE_DTYPES}")
  return None
