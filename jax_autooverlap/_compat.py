"""Version shims for jax-triton.  Import `jax_triton` only through `import_jax_triton()`.

jax-triton 0.4.1 imports `TMA_TF32` from triton's NVIDIA driver module, which
only triton >= 3.7 defines.  On triton 3.6 (the GPU machine's pinned version)
the import fails and jax-triton silently swaps in a stub backend that cannot
compile anything.  Defining the constant first (11 is its value in triton
3.7's driver) lets the real backend load.

Three more fixes make jax-triton 0.4.1 compile and launch Gluon kernels
(`triton.experimental.gluon`), all installed by `import_jax_triton()`:
1. descriptor metadata: jax-triton requires an `is_im2col` key in every
   host-side TMA descriptor's metadata; triton 3.6, which has no im2col
   descriptors, does not write it.  We add `is_im2col: False` where triton
   left it out (`_GluonAwareStages.make_ttgir`).
2. front end: jax-triton runs triton's `make_ttir`/`make_ttgir` on every
   module.  A Gluon module is already TritonGPU IR; triton compiles it with the
   backend's `gluon_to_ttgir` stage, and the `make_ttgir` pipeline adds a
   `wgmma.wait_group 0` to its MMA loop (measured 0.408 vs 0.339 ms at
   4096x8192x4096 on H200).  Gluon modules go through `gluon_to_ttgir`.
3. launch width (an upstream jax-triton bug, any triton version): jax-triton
   launches `num_warps` warps, while a warp-specialised kernel needs
   `ttg.total-num-warps` (e.g. 8 + 4 for one extra producer warp group), and
   the launch fails with CUDA_ERROR_INVALID_VALUE.  The compiled PTX states
   the block size the kernel requires (`.reqntid`); we launch that many
   threads (`_LaunchWidthFromPtx`).
"""
from __future__ import annotations

import re
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
  _install_gluon_shims(triton_lib)
  return jax_triton


def is_gluon_module(module) -> bool:
  """A Gluon kernel's module is TritonGPU IR from the start: it carries ttg.num-warps (a
  Triton kernel's TTIR gets it only in make_ttgir)."""
  return module.get_int_attr("ttg.num-warps") is not None


class _GluonAwareStages:
  """The CUDA backend as jax-triton's compile function sees it (fixes 1 and 2 above)."""

  def __init__(self, backend):
    self._backend = backend

  def __getattr__(self, name):
    return getattr(self._backend, name)

  def make_ttir(self, mod, metadata, options, capability):
    if is_gluon_module(mod):
      return mod  # no TTIR stage: Gluon is lowered from TritonGPU IR
    return self._backend.make_ttir(mod, metadata, options, capability)

  def make_ttgir(self, mod, metadata, options, capability):
    if is_gluon_module(mod):
      mod = self._backend.gluon_to_ttgir(mod, metadata, options, capability)
    else:
      mod = self._backend.make_ttgir(mod, metadata, options, capability)
    for meta in metadata.get("tensordesc_meta") or ():
      meta.setdefault("is_im2col", False)
    return mod


_REQNTID = re.compile(r"^\s*\.reqntid\s+(\d+)", re.MULTILINE)


def launch_warps(binary, num_warps: int) -> int:
  """Warps to launch a compiled kernel with: its PTX's required block size (`.reqntid`), which
  counts every partition of a warp-specialised kernel, else `num_warps`."""
  match = _REQNTID.search(binary) if isinstance(binary, str) else None
  return int(match.group(1)) // 32 if match else num_warps


class _LaunchWidthFromPtx:
  """jaxlib's gpu_triton module, with kernels launched at their PTX's block size (fix 3)."""

  def __init__(self, lib):
    self._lib = lib

  def __getattr__(self, name):
    return getattr(self._lib, name)

  def TritonKernel(self, name, num_warps, num_ctas, shared_mem_bytes, binary, *rest):  # noqa: N802
    return self._lib.TritonKernel(name, launch_warps(binary, num_warps), num_ctas, shared_mem_bytes,
                                  binary, *rest)


def _install_gluon_shims(triton_lib):
  if getattr(triton_lib, "_ao_gluon_shims", False):
    return
  compile_ptx = triton_lib.compile_ttir_to_ptx_inplace

  def compile_ttir_to_ptx_inplace(ttir, cuda_backend, *args, **kwargs):
    return compile_ptx(ttir, _GluonAwareStages(cuda_backend), *args, **kwargs)

  triton_lib.compile_ttir_to_ptx_inplace = compile_ttir_to_ptx_inplace
  if triton_lib.triton_kernel_call_lib is not None:
    triton_lib.triton_kernel_call_lib = _LaunchWidthFromPtx(triton_lib.triton_kernel_call_lib)
  triton_lib._ao_gluon_shims = True


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
