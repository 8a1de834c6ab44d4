"""Trace-time context of fused ops: the concrete mesh they run on (GPU kernels need its
devices) and whether their program keeps custom calls out of XLA's CUDA graphs."""
from __future__ import annotations

import contextlib
import contextvars
import os

import jax
import numpy as np

_MESH = contextvars.ContextVar("jax_autooverlap_mesh", default=None)
_GRAPH_SAFE = contextvars.ContextVar("jax_autooverlap_graph_safe", default=False)


@contextlib.contextmanager
def use_mesh(mesh):
  """Fused ops traced inside run on `mesh` (a jax.sharding.Mesh with devices)."""
  token = _MESH.set(mesh)
  try:
    yield
  finally:
    _MESH.reset(token)


# XLA's default command-buffer types, minus those that need their own flags.
_DEFAULT_COMMAND_BUFFER = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN")

GRAPH_CAPTURE = (
    "XLA may capture the kernel into a CUDA graph (command buffers with CUSTOM_CALL), which "
    "jax-triton's launch of a kernel with device-side TMA descriptors does not allow: use "
    "ao.jit as the outermost jit, or set XLA_FLAGS=--xla_gpu_enable_command_buffer="
    "FUSION,CUBLAS,CUBLASLT,CUDNN")


def command_buffer_types(xla_flags: str) -> tuple[str, ...]:
  """Command-buffer types XLA_FLAGS leaves on (a plain list replaces the default, +X/-X edit it)."""
  types = list(_DEFAULT_COMMAND_BUFFER)
  for flag in xla_flags.split():
    if not flag.startswith("--xla_gpu_enable_command_buffer="):
      continue
    values = [v.strip().upper() for v in flag.split("=", 1)[1].split(",") if v.strip()]
    if not values or not all(v[:1] in "+-" for v in values):
      types = []  # empty: all off; a plain list replaces the default
    for v in values:
      name = v.lstrip("+-")
      if v.startswith("-"):
        types = [t for t in types if t != name]
      elif name not in types:
        types.append(name)
  return tuple(types)


def compiler_options_keeping_custom_calls_out_of_graphs() -> dict[str, str]:
  """What ao.jit compiles with: XLA_FLAGS' command-buffer types without CUSTOM_CALL."""
  types = command_buffer_types(os.environ.get("XLA_FLAGS", ""))
  return {"xla_gpu_enable_command_buffer": ",".join(t for t in types if t != "CUSTOM_CALL")}


@contextlib.contextmanager
def compiled_without_custom_calls_in_graphs(safe: bool = True):
  """Fused ops traced inside go into a program that ao.jit compiles with custom calls
  kept out of CUDA graphs (or, safe=False, into some other program)."""
  token = _GRAPH_SAFE.set(safe)
  try:
    yield
  finally:
    _GRAPH_SAFE.reset(token)


def tracing_for_graph_safe_program() -> bool:
  """Inside the trace of a program that ao.jit compiles with custom calls out of graphs."""
  return _GRAPH_SAFE.get()


def graph_safe() -> bool:
  """May a Triton kernel traced here run: is it kept out of CUDA graphs?

  XLA captures runs of >= 5 commands (fusions, cuBLAS calls, custom calls; in
  loop bodies and at top level) into CUDA graphs, and jax-triton's launch of
  a kernel that builds TMA descriptors on the device (global scratch) cannot
  be captured (CUDA_ERROR_NOT_SUPPORTED on the second run, seen on H200 with
  jax 0.11.2).  ao.jit compiles its programs with CUSTOM_CALL removed from the
  command-buffer types; elsewhere only XLA_FLAGS can do it.
  """
  return _GRAPH_SAFE.get() or "CUSTOM_CALL" not in command_buffer_types(
      os.environ.get("XLA_FLAGS", ""))


def current_mesh():
  """The concrete mesh in scope (ao.jit's shard_map, or jax.set_mesh), else None."""
  for mesh in (_MESH.get(), _global_mesh()):
    if mesh is not None and _devices(mesh) is not None:
      return mesh
  return None


def _global_mesh():
  try:
    mesh = jax.sharding.get_mesh()
  except Exception:
    return None
  return None if getattr(mesh, "empty", True) else mesh


def _devices(mesh):
  try:
    return np.asarray(mesh.devices)
  except Exception:  # AbstractMesh
    return None


def platform(mesh) -> str | None:
  devices = _devices(mesh) if mesh is not None else None
  return None if devices is None else devices.flat[0].platform
