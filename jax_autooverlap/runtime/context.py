"""Trace-time context of fused ops: the concrete mesh they run on (GPU kernels need its
devices), and whether the trace is ao.explain's (which never times anything)."""
from __future__ import annotations

import contextlib
import contextvars

import numpy as np

_MESH = contextvars.ContextVar("jax_autooverlap_mesh", default=None)


def _explaining_state():
  """A JAX config state in jit's cache key: 0 outside ao.explain, else 1 + the number of
  verdicts measured in this process so far.  So a program traced for ao.explain (where shapes
  still to be measured are planned without measuring) is never reused by a call, nor by an
  explain after a measurement."""
  from jax._src import config
  name = "jax_autooverlap_explaining"
  return config.config_states.get(name) or config.int_state(
      name, 0, "ao.explain is tracing (jax_autooverlap internal)", include_in_jit_key=True,
      include_in_trace_context=True)


_EXPLAINING = _explaining_state()
_measured = [0]


def measured() -> None:
  """A first-call measurement decided a verdict (explain's traces from before are stale)."""
  _measured[0] += 1


def explaining():
  """Context manager: what is traced inside is ao.explain's trace (plans, never measures)."""
  return _EXPLAINING(1 + _measured[0])


def is_explaining() -> bool:
  return bool(_EXPLAINING.value)


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
