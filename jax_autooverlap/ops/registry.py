"""The fused ops' canonical cores and their implementations, by name, and the dispatch.

A core (`ag_rows`, `ag_k`, `rs_rows`; ops/ag_matmul.py and ops/matmul_rs.py)
computes one fused op on canonical operands [B, M, K] x [B, K, N] and holds
its implementations: the reference ring (any platform), the unfused program
(the plain collective and dot_general) and, where one exists, the GPU kernel
(engines `tl` and `gluon`, chosen by the KernelConfig).  Each implementation
says where it cannot run (`unsupported(call) -> Reason | None`); the planner
(ops/planning.py) asks, and ao.explain shows the answer.  A core's VJP runs
its dual core, which it finds here by name (no import between the two ops).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jax import lax

from jax_autooverlap import fp8
from jax_autooverlap.reasons import Reason


@dataclasses.dataclass(frozen=True)
class Call:
  """One canonical call as the planner sees it (sizes per device)."""
  op: str            # the core's name
  axis_size: int
  batch: int
  rows: int          # ag_rows: rows of the shard; ag_k, rs_rows: rows of the operand
  k: int             # the contraction (ag_k: gathered, i.e. n times the shard's)
  cols: int
  dtype: Any         # the operands' dtype (operand_dtype), None where they differ
  out_dtype: Any


def operand_dtype(a_dtype, b_dtype):
  """The dtype a fused call is planned, tuned and keyed by: the operands' common dtype, or
  the first operand's where both are fp8 (the fp8 kernels take any e4m3/e5m2 pairing), None
  where they differ otherwise."""
  if a_dtype == b_dtype or (fp8.is_fp8(a_dtype) and fp8.is_fp8(b_dtype)):
    return a_dtype
  return None


def kernel_2d_unsupported(call: Call) -> Reason | None:
  """What the GPU kernels of both ops need from a call: one dtype (or two fp8 formats), 2-D
  operands."""
  if call.dtype is None:
    return Reason("mixed_dtypes", "operands of different dtypes")
  if call.batch != 1:
    return Reason("batched", f"batched matmul (batch {call.batch}); the GPU kernel covers 2-D "
                  "operands")
  return None


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation of a core: run(a, b, cp, need_gathered, scale=None) -> out, or
  (out, gathered) where the core returns the gathered operand.  scale (fp8 operands): f32[],
  the product of the per-tensor scales, applied to the f32 product before the output cast."""
  name: str  # "reference" | "unfused" | "triton" (the GPU kernel)
  run: Callable
  unsupported: Callable[[Call], Reason | None] = lambda call: None


@dataclasses.dataclass(frozen=True)
class Core:
  name: str
  what: str     # what it computes, in words
  fn: Callable  # the differentiable core: fn(a, b, cp)
  impls: dict   # name -> Impl
  gathers: bool  # returns (out, gathered) from its implementations

  def kernel_unsupported(self, call: Call) -> Reason | None:
    kernel = self.impls.get("triton")
    if kernel is None:
      return Reason("no_kernel", f"no GPU kernel for {self.what} yet")
    return kernel.unsupported(call)


CORES: dict[str, Core] = {}


def register(core: Core) -> Core:
  CORES[core.name] = core
  return core


def core(name: str) -> Core:
  return CORES[name]


def is_core_call(eqn) -> bool:
  """Is this equation a call of one of the cores (a fused op already in the program)?"""
  if eqn.primitive.name != "custom_vjp_call":
    return False
  bwd = getattr(eqn.params.get("bwd"), "f", None)  # the core's backward rule
  return any(bwd is c.fn.bwd for c in CORES.values())


def dispatch(name: str, a, b, cp, need_gathered: bool = True, scale=None):
  """Run the implementation cp.impl names ("platform": chosen per platform at lowering)."""
  c = CORES[name]
  if cp.impl in c.impls:
    return c.impls[cp.impl].run(a, b, cp, need_gathered, scale)
  if cp.impl != "platform":
    raise ValueError(f"{name}: no implementation {cp.impl!r} (has {sorted(c.impls)})")
  # No concrete mesh at trace time: the reference ring, except on GPUs, where the unfused
  # program (NCCL + cuBLAS) beats it.
  ring = lambda a, b, s: c.impls["reference"].run(a, b, cp, need_gathered, s)
  unfused = lambda a, b, s: c.impls["unfused"].run(a, b, cp, need_gathered, s)
  return lax.platform_dependent(a, b, scale, cuda=unfused, rocm=unfused, default=ring)

