"""Trace-time context of fused ops: the concrete mesh they run on (GPU kernels need its
devices)."""
from __future__ import annotations

import contextlib
import contextvars

import numpy as np

_MESH = contextvars.ContextVar("jax_autooverlap_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh):
  """Fused ops traced inside run on `mesh` (a jax.sharding.Mesh with devices)."""
  token = _MESH.set(mesh)
  try:
    yield
  finally:
    _MESH.reset(token)


def current_mesh():
  """The concrete mesh in scope (ao.jit's shard_map, or jax.set_mesh), else None."""
  for mesh in (_MESH.get(), _global_mesh()):
    if mesh is not None and _devices(mesh) is not None:
      return mesh
  return None


def _global_mesh():
  """The mesh of `jax.set_mesh`, also while tracing (jax.sharding.get_mesh refuses under jit;
  jax 0.11 keeps it in jax._src.mesh, and the jit cache is keyed by it)."""
  from jax._src import mesh as mesh_lib
  try:
    mesh = mesh_lib.get_concrete_mesh()
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
