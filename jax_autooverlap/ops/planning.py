"""Which implementation runs a fused call, and why (shared by the ops and ao.explain).

`plan` decides per canonical call (a core of ops/registry.py with sizes
(batch, rows, contraction, columns) per device) between the reference ring,
the unfused program and the GPU kernel: the core says where its kernel cannot
run, the tuner (tuning/select.py) picks a kernel config or the unfused
program, the first call measures the candidates where no verdict exists
(ops/measure.py; never in ao.explain's trace, whose rows say "first_call"),
and the workspace must cover the axis' groups.  `describe` answers the same
question for a match of the rewrite; `dual_params` plans the dual op of a
backward pass.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np

from jax_autooverlap import fp8
from jax_autooverlap.ops import measure, registry
from jax_autooverlap.ops.dims import DotDims
from jax_autooverlap.ops.ring import RingParams
from jax_autooverlap.reasons import Reason, code_of
from jax_autooverlap.runtime import context, cuda, workspace
from jax_autooverlap.tuning import model as cost_model
from jax_autooverlap.tuning import select
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
         mesh=None, *, axis_name=None, may_time=False,
         b_dtype=None) -> tuple[str, GpuPlan | None, Reason]:
  """Which implementation runs a fused call: (impl, gpu plan, why).

  `op` is the core ("ag_rows", "ag_k", "rs_rows"); `canonical` its (batch,
  rows, contraction, columns) sizes per device.  Shared by the ops and by
  ao.explain, so the report says what actually runs.  Where the tuner picks
  the kernel, the workspace registry must also support the axis' groups
  (collective over the mesh's processes: the same answer in every process).
  `may_time` (the ops' trace, never ao.explain's) lets a shape without a
  measured verdict be measured now; otherwise its reason says "first_call".  `b_dtype`: the
  second operand's format where it differs from `dtype` (two fp8 formats: the measurement
  makes each operand in its own, and the pairing has its own verdict).
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
    first = np.asarray(mesh.devices).flat[0]
    choose = select.choose_ag if op == "ag_rows" else select.choose_rs
    verdict = choose(config, first.device_kind, axis_size, rows, k, cols, dtype, out_dtype,
                     compute_capability=_compute_capability(mesh), props=_props(first),
                     b_dtype=b_dtype)
    why = verdict.reason
    if verdict.kernel is not None or verdict.source == "first_call":
      support = workspace.REGISTRY.support(mesh, axis_name, workspace.kernel_bytes(
          op, axis_size, rows, k, cols, dtype, out_dtype))
      if not support.ok:
        why = Reason("workspace", support.reason)
      elif verdict.source == "first_call":
        if not may_time or axis_name is None or context.is_explaining():
          return "unfused", None, verdict.reason  # ao.explain: what the first call will do
        verdict = measure.first_call(op, verdict, mesh, axis_name, (rows, k, cols), dtype,
                                     out_dtype, functools.partial(
                                         _measured_params, op, mesh, axis_name, out_dtype,
                                         config.timeout_s), b_dtype)
        context.measured()
        why = verdict.reason
      if support.ok and verdict.kernel is not None:
        spread = f", {support.reason}" if support.processes > 1 else ""
        return "triton", GpuPlan(mesh, verdict.kernel, config.timeout_s), Reason(
            "kernel", f"triton kernel ({verdict.reason}; {_engine(op, verdict.kernel)}){spread}")
  if config.impl == "triton":
    raise ValueError(f"{op}: impl='triton' cannot run here: {why}")
  return "unfused", None, Reason(code_of(why) or "tuner_unfused", f"unfused program on gpu ({why})")


def _engine(op: str, kernel: KernelConfig) -> str:
  """The engine as explain names it (with the GEMM+RS warpgroup partitions where they run)."""
  wg = ", a consumer partition per warpgroup" if kernel.wg_partitions and op == "rs_rows" else ""
  return f"{kernel.engine} engine{wg}"


def _compute_capability(mesh):
  """The mesh's GPUs' compute capability ("9.0"), None where the devices do not say."""
  return getattr(np.asarray(mesh.devices).flat[0], "compute_capability", None)


def _props(device):
  """The device's properties for a cost model derived for its kind (tuning/model.py): read
  from the driver where this process drives the device, else the table's."""
  read = None
  if device.platform == "gpu" and device.process_index == jax.process_index():
    read = _read_props(device.local_hardware_id)
  return cost_model.device_props(device.device_kind, read)


@functools.cache
def _read_props(ordinal: int):
  try:
    return cost_model.DeviceProps(**cuda.device_properties(ordinal), nvlink_gbps=0.0,
                                  source="device")
  except Exception:  # noqa: BLE001 - no driver to ask: the table's values stand
    return None


def _measured_params(op, mesh, axis_name, out_dtype, timeout_s, kernel):
  """CoreParams of the op alone on a 2-D call (what the first-call measurement times):
  the unfused program (kernel None) or the kernel `kernel`."""
  n = mesh.shape[axis_name]
  return CoreParams(ring=RingParams(axis_name, n, 1, None, np.dtype(out_dtype)),
                    impl="unfused" if kernel is None else "triton",
                    gpu=None if kernel is None else GpuPlan(mesh, kernel, timeout_s))


def core_params(op, ring: RingParams, a3, b3, config: OverlapConfig, mesh,
                return_gathered=False) -> CoreParams:
  """Params of a canonical call on a3 [B, M, K], b3 [B, K, N], with the impl `plan` picks."""
  n = ring.axis_size
  canonical = (a3.shape[0], a3.shape[1], a3.shape[2], b3.shape[2])
  if op == "ag_k":  # the gathered operand is b3 [B, k, N]
    canonical = (a3.shape[0], a3.shape[1], b3.shape[1] * n, b3.shape[2])
  dtype = registry.operand_dtype(a3.dtype, b3.dtype)
  impl, gpu, _ = plan(op, config, n, canonical, dtype, ring.out_dtype, mesh,
                      axis_name=ring.axis_name, may_time=True,
                      b_dtype=b3.dtype if b3.dtype != dtype else None)
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
             dtype, out_dtype, config: OverlapConfig, mesh, axis_name=None,
             dtypes=None) -> Reason:
  """What `plan` will choose for a match of the rewrite (dot shapes as in the program); a
  forced implementation that cannot run here gives an "impl_unavailable" reason.  dtypes: the
  (lhs, rhs) formats where they are two fp8 formats, planned as the call will be (the
  canonical a's first, core_params)."""
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
  b_dtype = None
  if dtypes is not None and dtypes[0] != dtypes[1] and all(map(fp8.is_fp8, dtypes)):
    a = operand if op != "ag_k" else 1 - operand  # the canonical a: the gathered rows' side
    dtype, b_dtype = dtypes[a], dtypes[1 - a]
  try:
    return plan(op, config, axis_size, canonical, dtype, out_dtype, mesh, axis_name=axis_name,
                b_dtype=b_dtype)[2]
  except ValueError as e:
    return Reason("impl_unavailable", str(e))
