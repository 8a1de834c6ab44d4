"""Which implementation runs a fused call, and why (shared by the ops and ao.explain).

`plan` decides per canonical call (ag_rows / ag_k / rs_rows with sizes
(batch, rows, contraction, columns) per device) between the reference ring,
the unfused program and the GPU kernels, consulting the tuner (and, where
asked, autotuning the cost model's choice on programs it builds here);
`describe` answers the same question for a match of the rewrite;
`dual_params` plans the dual op of a backward pass.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jax_autooverlap.ops import fused
from jax_autooverlap.ops.reference import RingParams
from jax_autooverlap.runtime import context, workspace
from jax_autooverlap.tuning import autotune, select
from jax_autooverlap.tuning.config import KernelConfig, OverlapConfig


class DotDims:
  """Batch, contracting and free dims of both operands of a dot_general."""

  def __init__(self, dn, lhs_ndim, rhs_ndim):
    (lc, rc), (lb, rb) = dn
    self.lb, self.rb = tuple(map(int, lb)), tuple(map(int, rb))
    self.lc, self.rc = tuple(map(int, lc)), tuple(map(int, rc))
    self.lf = tuple(d for d in range(lhs_ndim) if d not in self.lb + self.lc)
    self.rf = tuple(d for d in range(rhs_ndim) if d not in self.rb + self.rc)

  def side(self, operand: int):
    """(batch, contracting, free) of one operand and of the other one."""
    mine = (self.lb, self.lc, self.lf) if operand == 0 else (self.rb, self.rc, self.rf)
    other = (self.rb, self.rc, self.rf) if operand == 0 else (self.lb, self.lc, self.lf)
    return mine, other


def plan(op: str, config: OverlapConfig, axis_size: int, canonical, dtype, out_dtype,
         mesh=None, *, axis_name=None, may_time=False) -> tuple[str, "fused.GpuPlan | None", str]:
  """Which implementation runs a fused call: (impl, gpu plan, human-readable reason).

  `op` is the canonical core ("ag_rows", "ag_k", "rs_rows"); `canonical` its
  (batch, rows, contraction, columns) sizes per device.  Shared by the ops
  and by ao.explain, so the report says what actually runs.  Where the tuner
  picks the kernel, the workspace registry must also support the axis' groups
  (collective over the mesh's processes: the same answer in every process).
  `may_time` (the ops' first call, never ao.explain) lets a cost-model choice
  be autotuned where the config asks for it.
  """
  if config.impl in ("reference", "unfused"):
    return config.impl, None, f"{config.impl} (forced by OverlapConfig)"
  mesh = mesh if mesh is not None else context.current_mesh()
  platform = context.platform(mesh)
  if platform is None:
    if config.impl == "triton":
      raise ValueError(f"{op}: impl='triton' needs the concrete mesh: call inside ao.jit or under "
                       "jax.set_mesh(mesh)")
    return "platform", None, "chosen at lowering: reference ring on CPU/TPU, unfused on GPU"
  if platform != "gpu":
    if config.impl == "triton":
      raise ValueError(f"{op}: impl='triton' needs NVIDIA GPUs, the mesh is on {platform}")
    return "reference", None, f"reference ring (chunked ppermute) on {platform}"
  batch, rows, k, cols = canonical
  why = None
  if op == "ag_k":
    why = "no GPU kernel for contracting-dim gathers yet"
  elif dtype is None:
    why = "operands of different dtypes"
  elif axis_size == 1 and config.impl != "triton":  # asked for explicitly: runs (tests)
    why = "axis of size 1: a plain matmul"
  elif batch != 1:
    why = f"batched matmul (batch {batch}); the GPU kernel covers 2-D operands"
  else:
    device_kind = np.asarray(mesh.devices).flat[0].device_kind
    choose = select.choose_ag if op == "ag_rows" else select.choose_rs
    verdict = choose(config, device_kind, axis_size, rows, k, cols, dtype, out_dtype)
    support = None
    verdict = _autotuned(op, verdict, config, mesh, axis_name if may_time else None,
                         (rows, k, cols), dtype, out_dtype)
    if verdict.kernel is not None:
      support = workspace.REGISTRY.support(mesh, axis_name, workspace.kernel_bytes(
          op, axis_size, rows, k, cols, dtype, out_dtype))
    if support is not None and support.ok:
      spread = f", {support.reason}" if support.processes > 1 else ""
      return "triton", fused.GpuPlan(mesh, verdict.kernel, config.timeout_s), \
          f"triton kernel ({verdict.reason}; {_engine(op, verdict.kernel)}){spread}"
    why = verdict.reason if support is None else support.reason
  if config.impl == "triton":
    raise ValueError(f"{op}: impl='triton' cannot run here: {why}")
  return "unfused", None, f"unfused program on gpu ({why})"


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
    return dataclasses.replace(verdict, reason=f"{verdict.reason}; autotuned on the first call")
  why_not = autotune.why_not()
  if why_not:
    return dataclasses.replace(verdict, reason=f"{verdict.reason}; {why_not}")
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
  kernels need), on fresh random inputs: the unfused program, or the kernel `kernel`."""
  import jax
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jax_autooverlap import api  # the top of the package: imported when used
  rows, k, cols = sizes
  n = mesh.shape[axis_name]
  dn = (((1,), (0,)), ((), ()))
  dot = lambda x, w: lax.dot_general(x, w, dn, preferred_element_type=out_dtype)
  if op == "ag_rows":
    body = lambda x, w: dot(lax.all_gather(x, axis_name, axis=0, tiled=True), w)
    shapes, specs, out_spec = ((n * rows, k), (k, n * cols)), (P(axis_name), P(None, axis_name)), \
        P(None, axis_name)
  else:
    body = lambda x, w: lax.psum_scatter(dot(x, w), axis_name, scatter_dimension=0, tiled=True)
    shapes, specs, out_spec = ((rows, n * k), (n * k, cols)), (P(None, axis_name), P(axis_name)), \
        P(axis_name)
  program = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec)
  fn = jax.jit(program) if kernel is None else api.jit(
      program, overlap_config=OverlapConfig(impl="triton", kernel=kernel))
  keys = iter(jax.random.split(jax.random.key(sum(sizes)), 2 * input_sets))
  arg_sets = [tuple(jax.device_put(jax.random.normal(next(keys), shape, np.float32).astype(dtype),
                                   NamedSharding(mesh, spec)) for shape, spec in zip(shapes, specs))
              for _ in range(input_sets)]
  return autotune.time_call(fn, arg_sets)


def dual_params(op, a3, b3, ring: RingParams, config: OverlapConfig, out_dtype, mesh,
                return_gathered=False):
  """Plan for the dual op of a backward pass (other shapes, same axis, mesh and config).

  The backward pass is traced later, outside the forward's context: the mesh
  comes from the forward.
  """
  ring = dataclasses.replace(ring, out_dtype=np.dtype(out_dtype))
  if config.impl == "triton":  # forced for the forward op; the dual may not fit the kernel
    config = dataclasses.replace(config, impl="auto", kernel=None)
  return core_params(op, ring, a3, b3, config, mesh, return_gathered)


def core_params(op, ring: RingParams, a3, b3, config: OverlapConfig, mesh,
                return_gathered=False) -> "fused.CoreParams":
  """Params of a canonical call on a3 [B, M, K], b3 [B, K, N], with the impl `plan` picks."""
  n = ring.axis_size
  canonical = (a3.shape[0], a3.shape[1], a3.shape[2], b3.shape[2])
  if op == "ag_k":  # the gathered operand is b3 [B, k, N]
    canonical = (a3.shape[0], a3.shape[1], b3.shape[1] * n, b3.shape[2])
  dtype = a3.dtype if a3.dtype == b3.dtype else None
  impl, gpu, _ = plan(op, config, n, canonical, dtype, ring.out_dtype, mesh,
                      axis_name=ring.axis_name, may_time=True)
  return fused.CoreParams(ring=ring, impl=impl, return_gathered=return_gathered, gpu=gpu,
                          config=config, mesh=mesh)


def describe(kind: str, lhs_shape, rhs_shape, operand: int, dim: int, dn, axis_size: int,
             dtype, out_dtype, config: OverlapConfig, mesh, axis_name=None) -> str:
  """What `plan` will choose for a match of the rewrite (dot shapes as in the program)."""
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
    return f"error: {e}"
