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


def under_a_transformation(args) -> bool:
  """Is this call being traced into an outer program (jit, grad, vmap) rather than run?

  Tracer arguments say so; a call without array arguments that closes over an
  outer jit's values is only visible in JAX's trace state (jax._src.core,
  present in jax 0.11, which pyproject pins).
  """
  import jax
  from jax._src import core
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
    return True
  return not core.trace_state_clean()
