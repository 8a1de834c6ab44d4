"""The loopback's device programs: the fused kernel as rank 0 (after the set-up kernel that
re-arms the peer's arrival counters, kernels/loopback.py), the Gluon engine's plain GEMM on the
same local work, and XLA's GEMM (cuBLAS; for fp8 operands its fp8 GEMM, cuBLASLt, on b stored
K-major as the fp8 kernels read it)."""
from __future__ import annotations

from jax_autooverlap.bench.loopback.fixture import WORLD, Case, np_dtype, workspace_bytes


def _arm(table, world: int = WORLD, compute_capability=None):
  """The loopback set-up kernel before each fused call (kernels/loopback.py): arms rank 0's
  counters from the world - 1 peers."""
  import jax
  from jax_autooverlap._compat import import_jax_triton
  from jax_autooverlap.kernels.loopback import loopback_arm_kernel
  from jax_autooverlap.runtime import workspace
  jt = import_jax_triton()
  n = max(table.shape[0], 2 * world * workspace.MAX_CHUNKS)
  return jt.triton_call(
      table, kernel=loopback_arm_kernel, name="ao_loopback_arm",
      out_type=jax.ShapeDtypeStruct(table.shape, table.dtype), grid=(1,), num_warps=4,
      compute_capability=compute_capability,
      TABLE_LEN=table.shape[0], WORLD=world, FLAGS_OFF=workspace.FLAGS_OFFSET,
      MAX_CHUNKS=workspace.MAX_CHUNKS, BLOCK=1 << (n - 1).bit_length())


def fused_program(case: Case, kernel, num_sms: int, timeout_s: float = 10.0,
                  compute_capability: int | None = None, return_gathered: bool = False,
                  trace: bool = False, poison: bool = False):
  """jit(a, b, table, rank) -> rank 0's output in a group of case.world (ag with
  return_gathered: (output, gathered shards)): set-up kernel, then the fused kernel
  (compute_capability: compile-only checks on a machine without a GPU).  trace (both
  engines, both ops): (output, the kernel's per-unit timeline).  poison (tests):
  the outputs are zeroed before the kernel runs, so elements it fails to write show as
  zeros."""
  import functools
  import jax
  if trace and kernel.engine == "gluon":  # the Gluon launchers themselves (GEMM+RS too)
    from jax_autooverlap.backends import gluon as backend
  else:
    from jax_autooverlap.backends import triton as backend
  if kernel is not None and kernel.wg_partitions and case.op != "rs":
    raise ValueError("fused_program: wg_partitions is built for GEMM+RS only")
  extra = dict(trace=True) if trace else {}
  launch_ag_gemm = functools.partial(backend.launch_ag_gemm, **extra)
  launch_gemm_rs = functools.partial(backend.launch_gemm_rs, **extra)
  dtype = np_dtype(case.out_dtype)
  common = dict(world=case.world, kernel=kernel, out_dtype=dtype, timeout_s=timeout_s,
                num_sms=num_sms, compute_capability=compute_capability, poison=poison,
                workspace_bytes=workspace_bytes(case))

  def run(a, b, table, rank):
    # data dependence: the set-up kernel runs first
    table = _arm(table, case.world, compute_capability=compute_capability)
    if case.op == "ag":
      return launch_ag_gemm(a, b, table, rank, return_gathered=return_gathered, **common)
    return launch_gemm_rs(a, b, table, rank, **common)
  return jax.jit(run)


def engine_program(kernel, num_sms: int, compute_capability: int | None = None,
                   trace: bool = False, out_dtype=None):
  """jit(a, b) -> a @ b on the Gluon engine alone (no communication), same tiles and stages
  (trace: (a @ b, the per-tile timeline)); out_dtype: the product's (default a's)."""
  import jax
  from jax_autooverlap.backends.gluon import launch_gemm

  def run(a, b):
    return launch_gemm(a, b, kernel=kernel, out_dtype=out_dtype or a.dtype, num_sms=num_sms,
                       compute_capability=compute_capability, trace=trace)
  return jax.jit(run)


def gemm_program(case: Case | None = None):
  """XLA's GEMM of the local work into the case's product dtype: a @ b, or for fp8 operands
  the fp8 GEMM a @ b^T."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  out = None if case is None else jnp.dtype(np_dtype(case.out_dtype))
  if case is not None and case.fp8:
    return jax.jit(lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                preferred_element_type=out))
  return jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=out))
