"""The concrete mesh a fused op runs on (GPU kernels need its devices at trace time)."""
from __future__ import annotations

import contextlib
import contextvars
import os

import jax
import numpy as np

_MESH = contextvars.ContextVar("jax_autooverlap_mesh", default=None)
_IN_LOOP = contextvars.ContextVar("jax_autooverlap_in_loop", default=False)


@contextlib.contextmanager
def use_mesh(mesh):
  """Fused ops traced inside run on `mesh` (a jax.sharding.Mesh with devices)."""
  token = _MESH.set(mesh)
  try:
    yield
  finally:
    _MESH.reset(token)


@contextlib.contextmanager
def inside_loop():
  """Fused ops traced inside are in the body of a scan/while loop."""
  token = _IN_LOOP.set(True)
  try:
    yield
  finally:
    _IN_LOOP.reset(token)


def in_loop() -> bool:
  return _IN_LOOP.get()


def loop_kernels_blocked() -> str | None:
  """Why a GPU kernel may not run in a loop body, or None.

  XLA captures loop bodies into CUDA graphs (command buffers); jax-triton's
  launch of kernels that build TMA descriptors on the device (they need a
  global scratch buffer) cannot be captured (CUDA_ERROR_NOT_SUPPORTED, seen on
  H200 with jax 0.11.2).  Custom calls stay out of command buffers when
  XLA_FLAGS sets --xla_gpu_enable_command_buffer without CUSTOM_CALL.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  for flag in flags.split():
    if flag.startswith("--xla_gpu_enable_command_buffer="):
      if "CUSTOM_CALL" not in flag.split("=", 1)[1].upper():
        return None
  return ("inside a loop body XLA captures the kernel into a CUDA graph, which its TMA "
          "scratch does not allow; set XLA_FLAGS=--xla_gpu_enable_command_buffer= (or a list "
          "without CUSTOM_CALL) to fuse here")


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
