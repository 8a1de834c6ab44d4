"""The concrete mesh a fused op runs on (GPU kernels need its devices at trace time)."""
from __future__ import annotations

import contextlib
import contextvars

import jax
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
