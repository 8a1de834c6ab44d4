"""Version shims for jax-triton.  Import `jax_triton` only through `import_jax_triton()`.

1. jax-triton 0.4.1 imports `TMA_TF32` from triton's NVIDIA driver module, which
   only triton >= 3.7 defines.  On triton 3.6 (the GPU machine's pinned version)
   the import fails and jax-triton silently swaps in a stub backend that cannot
   compile anything.  Defining the constant first (11 is its value in triton
   3.7's driver) lets the real backend load.
2. Global scratch as an operand.  A Triton kernel that builds TMA descriptors
   on the device gets an implicit global-scratch pointer parameter, and jaxlib
   (>= 0.11.1) backs it with a cuMemAllocAsync/cuMemFreeAsync around every
   launch.  Those become memory-allocation nodes when XLA captures the launch
   into a CUDA graph (command buffer), which CUDA refuses in child graphs
   (CUDA_ERROR_NOT_SUPPORTED on the program's second run).  Kernels registered
   with `lean_launch` instead declare the scratch as their last explicit
   parameter, an ordinary output buffer that XLA allocates
   (`scratch_out_type`); after compilation their PTX reads that parameter
   where it read the implicit one, and jaxlib is told the kernel needs no
   scratch, so a launch allocates nothing and can be captured.
3. No TTIR in the launch opaque.  jax-triton puts the kernel's TTIR text
   beside its PTX into the custom call's opaque, and jaxlib looks every
   launch up by that whole opaque (hashing it).  For our kernels (~40 KB
   opaque) that cost 4-5 us per synchronous call on H200 (launch-cost
   benchmark, 2026-12-01: +4.4 us over a cuBLAS call with the TTIR, +0.3 us
   without); jaxlib never reads the TTIR to launch, so `lean_launch` kernels
   are built without it.
"""
from __future__ import annotations

import dataclasses
import re
import types

_TMA_TF32 = 11

# Global scratch per CTA reserved for kernels whose scratch is an operand.  Our
# kernels make at most a handful of 128-byte TMA descriptors per CTA;
# compilation fails loudly if a kernel ever needs more.
SCRATCH_BYTES_PER_CTA = 1024
_SCRATCH_ALIGN = 128  # a TMA descriptor's alignment; XLA's buffers are 256-byte aligned
_lean_kernels: set[str] = set()


def lean_launch(kernel):
  """Register a @triton.jit kernel whose last parameter is its global scratch (an output):
  it is compiled to read that operand, and launched without TTIR in its opaque."""
  _lean_kernels.add(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
  return kernel


def scratch_out_type(num_ctas: int):
  """The scratch output a launch of such a kernel passes: SCRATCH_BYTES_PER_CTA per CTA."""
  import jax
  import numpy as np
  return jax.ShapeDtypeStruct((num_ctas * SCRATCH_BYTES_PER_CTA,), np.uint8)


def redirect_scratch_param(ptx: str, name: str) -> str:
  """PTX of kernel `name` reading its last explicit parameter where it read the implicit scratch.

  Triton appends two implicit pointer parameters to every kernel (global
  scratch, then profile scratch); the explicit scratch operand is the one
  just before them.
  """
  entry = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx, re.S)
  if entry is None:
    raise RuntimeError(f"jax_autooverlap: no .entry {name} in the compiled PTX")
  params = re.findall(rf"\b({re.escape(name)}_param_\d+)\b", entry.group(1))
  if len(params) < 3:
    raise RuntimeError(f"jax_autooverlap: kernel {name} has {len(params)} parameters; expected "
                       "its scratch operand followed by Triton's two implicit scratch pointers")
  implicit, explicit = params[-2], params[-3]
  return ptx.replace(f"[{implicit}]", f"[{explicit}]")


def _scratch_as_operand(compiled):
  """A CompilationResult of a registered kernel, rewritten to use its scratch operand."""
  if compiled.name not in _lean_kernels:
    return compiled
  size, align = compiled.global_scratch_size or 0, compiled.global_scratch_align or 1
  if size > SCRATCH_BYTES_PER_CTA:  # Triton gives CTA i the bytes [i*size, (i+1)*size)
    raise RuntimeError(f"jax_autooverlap: kernel {compiled.name} needs {size} bytes of global "
                       f"scratch per CTA; its scratch operand holds {SCRATCH_BYTES_PER_CTA}")
  if align > _SCRATCH_ALIGN:
    raise RuntimeError(f"jax_autooverlap: kernel {compiled.name} needs its global scratch "
                       f"aligned to {align} bytes (> {_SCRATCH_ALIGN})")
  return dataclasses.replace(compiled, binary=redirect_scratch_param(compiled.binary, compiled.name),
                             global_scratch_size=None, global_scratch_align=None)


class _KernelLibWithoutTtir:
  """jaxlib's gpu_triton module, except that TritonKernels of lean kernels get no TTIR."""

  def __init__(self, lib):
    self._lib = lib

  def __getattr__(self, name):
    return getattr(self._lib, name)

  def TritonKernel(self, name, num_warps, num_ctas, shared_mem_bytes, binary, ttir, *rest):
    return self._lib.TritonKernel(name, num_warps, num_ctas, shared_mem_bytes, binary,
                                  "" if name in _lean_kernels else ttir, *rest)


def _install_launch_shims(triton_lib):
  compile_fn = triton_lib.compile_ttir_inplace
  if getattr(compile_fn, "_ao_shim", False):
    return

  def compile_ttir_inplace(*args, **kwargs):
    return _scratch_as_operand(compile_fn(*args, **kwargs))

  compile_ttir_inplace._ao_shim = True
  triton_lib.compile_ttir_inplace = compile_ttir_inplace
  triton_lib.triton_kernel_call_lib = _KernelLibWithoutTtir(triton_lib.triton_kernel_call_lib)


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
  if not hasattr(triton_lib, "compile_ttir_inplace"):
    raise ImportError("jax_autooverlap: this jax-triton has no compile_ttir_inplace; the "
                      "global-scratch shim (CUDA-graph-safe launches) needs jax-triton 0.4.x")
  _install_launch_shims(triton_lib)
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
