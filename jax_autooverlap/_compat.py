"""Version shims for jax-triton.  Import `jax_triton` only through `import_jax_triton()`.

jax-triton 0.4.1 imports `TMA_TF32` from triton's NVIDIA driver module, which
only triton >= 3.7 defines.  On triton 3.6 (the GPU machine's pinned version)
the import fails and jax-triton silently swaps in a stub backend that cannot
compile anything.  Defining the constant first (11 is its value in triton
3.7's driver) lets the real backend load.
"""
from __future__ import annotations

import types

_TMA_TF32 = 11


def import_jax_triton():
  """Import jax_triton with the triton-3.6 shim; fail loudly if its NVIDIA backend is a stub."""
  try:
    import triton.backends.nvidia.driver as nvidia_driver
  except ImportError as e:
    raise ImportError(f"jax_autooverlap: triton's NVIDIA backend cannot be imported ({e}); "
                      "install triton>=3.6 with its NVIDIA backend") from e
  if not hasattr(nvidia_driver, "TMA_TF32"):
    nvidia_driver.TMA_TF32 = _TMA_TF32
  import jax_triton
  from jax_triton import triton_lib
  if isinstance(getattr(triton_lib, "cb", None), types.SimpleNamespace):
    raise ImportError("jax_autooverlap: jax_triton loaded a stub NVIDIA backend "
                      f"(triton {getattr(__import__('triton'), '__version__', '?')}); "
                      "the triton/jax-triton pair is incompatible")
  return jax_triton


def varying_axes(x) -> frozenset:
  """Mesh axes a value varies over inside shard_map (its 'vma' type).

  jax 0.11 keeps them in `aval.manual_axis_type.varying`; earlier releases in
  `aval.vma`.  Empty outside shard_map and under check_vma=False.
  """
  import jax
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def under_a_transformation() -> bool:
  """Is this call being traced into an outer program (jit, grad, vmap) rather than run?

  Read from JAX's trace state (jax._src.core, as in jax 0.11, which pyproject
  pins): O(1) on every call, and it also sees calls without array arguments
  that close over an outer jit's values.
  """
  from jax._src import core
  return not core.trace_state_clean()
