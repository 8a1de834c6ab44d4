"""Which implementation runs a fused call, and why (shared by the ops and ao.explain).

`plan` decides per canonical call (a core of ops/registry.py with sizes
(batch, rows, contraction, columns) per device) between the reference ring,
the unfused program and the GPU kernel: the core says where its kernel cannot
run, the tuner (tuning/select.py) picks a kernel config or the unfused
program, first-call autotuning times the candidates where asked, and the
workspace must cover the axis' groups.  `describe` answers the same question
for a match of the rewrite; `dual_params` plans the dual op of a backward pass.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_autooverlap.ops import registry
from jax_autooverlap.ops.dims import DotDims
from jax_autooverlap.ops.ring import RingParams
from jax_autooverlap.reasons import Reason, code_of
from jax_autooverlap.runtime import context, workspace
from jax_autooverlap.tuning import autotune, select
from jax_autooverlap.tuning.config import KernelConfig, OverlapConfig, resolve_chunks


@dataclasses.dataclass(frozen=True)
class GpuPlan:
  """Everything the GPU kernel of one call needs besides its operands."""
  mesh: Any
  kernel: KernelConfig
  timeout_s: float


@dataclasses.dataclass(frozen=True)
class CoreParams:
  """The static half of a core call: ring params, the implementation that runs and its plan."""
  ring: RingParams
  impl: str  # "reference" | "unfused" | "triton" | "platform" (decided at lowering)
  return_gathered: bool = False
  gpu: GpuPlan | None = None
  config: Any = None  # the op's OverlapConfig, for planning the dual op of the backward pass
  mesh: Any = None


def plan(op: str, config: OverlapConfig, axis_size: int, canonical, dtype, out_dtype,
         mesh=None, *, axis_name=None, may_time=False) -> tuple[str, GpuPlan | None, Reason]:
  """Which implementation runs a fused call: (impl, gpu plan, why).

  `op` is the core ("ag_rows", "ag_k", "rs_rows"); `canonical` its (batch,
  rows, contraction, columns) sizes per device.  Shared by the ops and by
  ao.explain, so the report says what actually runs.  Where the tuner picks
  the kernel, the workspace registry must also support the axis' groups
  (collective over the mesh's processes: the same answer in every process).
  `may_time` (the ops' first call, never ao.explain) lets a cost-model choice
  be autotuned where the config asks for it.
  """
  if config.impl in ("reference", "unfused"):
    return config.impl, None, Reason("forced", f"{config.impl} (forced by OverlapConfig)")
  mesh = mesh if mesh is not None else context.current_mesh()
  platform = context.platform(mesh)
  if platform is None:
    if config.impl == "triton":
      raise ValueError(f"{op}: impl='triton' needs the concrete mesh: call inside ao.jit or under "
                       "jax.set_mesh(mesh)")
    return "platform", None, Reason(
        "platform_at_lowering", "chosen at lowering: reference ring on CPU/TPU, unfused on GPU")
  if platform != "gpu":
    if config.impl == "triton":
      raise ValueError(f"{op}: impl='triton' needs NVIDIA GPUs, the mesh is on {platform}")
    return "reference", None, Reason("not_gpu", f"reference ring (chunked ppermute) on {platform}")
  batch, rows, k, cols = canonical
  call = registry.Call(op, axis_size, batch, rows, k, cols, dtype, out_dtype)
  why = registry.core(op).kernel_unsupported(call)
  if why is None and axis_size == 1 and config.impl != "triton":  # asked for explicitly: runs
    why = Reason("axis_size_1", "axis of size 1: a plain matmul")
  if why is None:
    device_kind = np.asarray(mesh.devices).flat[0].device_kind
    choose = select.choose_ag if op == "ag_rows" else select.choose_rs
    verdict = choose(config, device_kind, axis_size, rows, k, cols, dtype, out_dtype)
    verdict = _autotuned(op, verdict, config, mesh, axis_name if may_time else None,
                         (rows, k, cols), dtype, out_dtype)
    why = verdict.reason
    if verdict.kernel is not None:
      support = workspace.REGISTRY.support(mesh, axis_name, workspace.kernel_bytes(
          op, axis_size, rows, k, cols, dtype, out_dtype))
      if support.ok:
        spread = f", {support.reason}" if support.processes > 1 else ""
        return "triton", GpuPlan(mesh, verdict.kernel, config.timeout_s), Reason(
            "kernel", f"triton kernel ({verdict.reason}; {_engine(op, verdict.kernel)}){spread}")
      why = Reason("workspace", support.reason)
  if config.impl == "triton":
    raise ValueError(f"{op}: impl='triton' cannot run here: {why}")
  return "unfused", None, Reason(code_of(why) or "tuner_unfused", f"unfused program on gpu ({why})")


def _engine(op: str, kernel: KernelConfig) -> str:
  """The engine as explain names it (with the GEMM+RS warpgroup partitions where they run)."""
  wg = ", a consumer partition per warpgroup" if kernel.wg_partitions and op == "rs_rows" else ""
  return f"{kernel.engine} engine{wg}"


def _autotuned(op, verdict: select.Verdict, config: OverlapConfig, mesh, axis_name, sizes, dtype,
               out_dtype) -> select.Verdict:
  """The cost model's choice, timed against its runners-up and the unfused program if asked."""
  if verdict.source != "model" or not verdict.candidates or not autotune.enabled(config):
    return verdict
  if axis_name is None:  # ao.explain: says what the first call will do, times nothing
    return dataclasses.replace(verdict, reason=Reason(
        code_of(verdict.reason), f"{verdict.reason}; autotuned on the first call"))
  why_not = autotune.why_not()
  if why_not:
    return dataclasses.replace(verdict, reason=Reason(code_of(verdict.reason),
                                                      f"{verdict.reason}; {why_not}"))
  rows, k, cols = sizes
  shard_rows = rows if op == "ag_rows" else rows // mesh.shape[axis_name]
  candidates = select.with_engines(op[:2], verdict.candidates, _compute_capability(mesh),
                                   (shard_rows, k, cols), dtype, out_dtype)
  time_program = functools.partial(_time_program, op, mesh, axis_name, sizes, dtype, out_dtype)
  return autotune.tune(op[:2], dataclasses.replace(verdict, candidates=candidates), time_program)


def _compute_capability(mesh):
  """The mesh's GPUs' compute capability ("9.0"), None where the devices do not say."""
  return getattr(np.asarray(mesh.devices).flat[0], "compute_capability", None)


def _time_program(op, mesh, axis_name, sizes, dtype, out_dtype, kernel: KernelConfig | None,
                  input_sets: int = 2) -> float:
  """ms per call of the op alone in shard_map over `mesh` (every device runs it, as the
  kernels need), on fresh random inputs: the core's unfused program, or its kernel `kernel`
  (the implementations the op itself runs, on 2-D operands)."""
  rows, k, cols = sizes
  n = mesh.shape[axis_name]
  core = registry.core(op)
  name = "unfused" if kernel is None else "triton"
  cp = CoreParams(ring=RingParams(axis_name, n, 1, None, np.dtype(out_dtype)), impl=name,
                  gpu=None if kernel is None else GpuPlan(mesh, kernel, OverlapConfig().timeout_s))

  def body(x, w):
    res = core.impls[name].run(x[None], w[None], cp, False)
    return (res[0] if core.gathers else res)[0]

  if op == "ag_rows":
    shapes, specs, out_spec = ((n * rows, k), (k, n * cols)), (P(axis_name), P(None, axis_name)), \
        P(None, axis_name)
  else:
    shapes, specs, out_spec = ((rows, n * k), (n * k, cols)), (P(None, axis_name), P(axis_name)), \
        P(axis_name)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec))
  keys = iter(jax.random.split(jax.random.key(sum(sizes)), 2 * input_sets))
  arg_sets = [tuple(jax.device_put(jax.random.normal(next(keys), shape, np.float32).astype(dtype),
                                   NamedSharding(mesh, spec)) for shape, spec in zip(shapes, specs))
              for _ in range(input_sets)]
  return autotune.time_call(fn, arg_sets)


def core_params(op, ring: RingParams, a3, b3, config: OverlapConfig, mesh,
                return_gathered=False) -> CoreParams:
  """Params of a canonical call on a3 [B, M, K], b3 [B, K, N], with the impl `plan` picks."""
  n = ring.axis_size
  canonical = (a3.shape[0], a3.shape[1], a3.shape[2], b3.shape[2])
  if op == "ag_k":  # the gathered operand is b3 [B, k, N]
    canonical = (a3.shape[0], a3.shape[1], b3.shape[1] * n, b3.shape[2])
  dtype = registry.operand_dtype(a3.dtype, b3.dtype)
  impl, gpu, _ = plan(op, config, n, canonical, dtype, ring.out_dtype, mesh,
                      axis_name=ring.axis_name, may_time=True)
  return CoreParams(ring=ring, impl=impl, return_gathered=return_gathered, gpu=gpu,
                    config=config, mesh=mesh)


def op_params(op, axis_name, n, a3, b3, precision, out_dtype, config, return_gathered=False):
  """Params of a public op's core call, traced now (the concrete mesh of the trace context)."""
  rows = {"ag_rows": a3.shape[1], "ag_k": b3.shape[1], "rs_rows": a3.shape[1] // n}[op]
  ring = RingParams(axis_name=axis_name, axis_size=n, chunks=resolve_chunks(config, rows),
                    precision=precision, out_dtype=np.dtype(out_dtype))
  return core_params(op, ring, a3, b3, config, context.current_mesh(), return_gathered)


def dual_params(op, a3, b3, cp: CoreParams, out_dtype, return_gathered=False) -> CoreParams:
  """Params of the dual op a backward pass runs on a3, b3 (same axis, mesh and config as the
  forward call cp; the backward pass is traced later, outside the forward's context)."""
  ring = dataclasses.replace(cp.ring, out_dtype=np.dtype(out_dtype))
  config = cp.config
  if config.impl == "triton":  # forced for the forward op; the dual may not fit the kernel
    config = dataclasses.replace(config, impl="auto", kernel=None)
  return core_params(op, ring, a3, b3, config, cp.mesh, return_gathered)


def describe(kind: str, lhs_shape, rhs_shape, operand: int, dim: int, dn, axis_size: int,
             dtype, out_dtype, config: OverlapConfig, mesh, axis_name=None) -> Reason:
  """What `plan` will choose for a match of the rewrite (dot shapes as in the program); a
  forced implementation that cannot run here gives an "impl_unavailable" reason."""
  dims = DotDims(dn, len(lhs_shape), len(rhs_shape))
  shapes = [list(lhs_shape), list(rhs_shape)]
  (ab, ac, af), (ob, oc, of) = dims.side(operand)
  mine, other = shapes[operand], shapes[1 - operand]
  size = lambda shape, ds: math.prod(shape[d] for d in ds)
  if kind == "ag_matmul":
    mine[dim] //= axis_size  # the shard
    op = "ag_rows" if dim in af else "ag_k"
  else:
    op = "rs_rows"
  canonical = (size(mine, ab), size(mine, af), size(mine, ac), size(other, of))
  if op == "ag_k":
    canonical = (size(mine, ab), size(other, of), size(other, oc), size(mine, af))
  try:
    return plan(op, config, axis_size, canonical, dtype, out_dtype, mesh, axis_name=axis_name)[2]
  except ValueError as e:
    return Reason("impl_unavailable", str(e))
