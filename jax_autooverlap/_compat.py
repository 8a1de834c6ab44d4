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

Three more make jax-triton 0.4.1 compile and launch Gluon kernels
(`triton.experimental.gluon`):
4. descriptor metadata: jax-triton requires an `is_im2col` key in every
   host-side TMA descriptor's metadata; triton 3.6, which has no im2col
   descriptors, does not write it.  We add `is_im2col: False` where triton
   left it out (`_GluonAwareStages.make_ttgir`).
5. front end: jax-triton runs triton's `make_ttir`/`make_ttgir` on every
   module.  A Gluon module is already TritonGPU IR; triton compiles it with the
   backend's `gluon_to_ttgir` stage, and the `make_ttgir` pipeline adds a
   `wgmma.wait_group 0` to its MMA loop (measured 0.408 vs 0.339 ms at
   4096x8192x4096 on H200).  Gluon modules go through `gluon_to_ttgir`.
6. launch width (an upstream jax-triton bug, any triton version): jax-triton
   launches `num_warps` warps, while a warp-specialised kernel needs
   `ttg.total-num-warps` (e.g. 8 + 4 for one extra producer warp group), and
   the launch fails with CUDA_ERROR_INVALID_VALUE.  The compiled PTX states
   the block size the kernel requires (`.reqntid`); we launch that many
   threads (`_KernelLib`).
7. PTX version (any triton whose ptxas is newer than the runtime's): jax-triton
   hands XLA the kernel's PTX, and XLA assembles it with the ptxas it finds
   (the machine's CUDA), not with the one triton ships.  Triton writes the
   highest `.version` its own ptxas accepts (triton 3.9: PTX 9.4 from CUDA
   13.4's ptxas), which CUDA 13.0's ptxas rejects ("Unsupported .version 9.4;
   current version is '9.0'", seen on the GPU machine, 2026-12-01).  We compile
   for the lowest PTX version among the ptxas binaries XLA may use
   (`runtime_ptxas`), when that is lower than triton's choice.
All are installed by `import_jax_triton()`.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import types

_TMA_TF32 = 11

# Global scratch per CTA reserved for kernels whose scratch is an operand: TMA descriptors of
# 128 bytes (the tl kernels make 4, the Gluon GEMM+RS one per peer besides: 1536 bytes at
# world 8).  Compilation fails loudly if a kernel ever needs more.
SCRATCH_BYTES_PER_CTA = 4096
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
                      "launch shims (CUDA-graph-safe launches, Gluon) need jax-triton 0.4.x")
  _install_shims(triton_lib)
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


class _KernelLib:
  """jaxlib's gpu_triton module, except that a TritonKernel is launched at its PTX's block size
  (fix 6) and, for lean kernels, built without TTIR (fix 3)."""

  def __init__(self, lib):
    self._lib = lib

  def __getattr__(self, name):
    return getattr(self._lib, name)

  def TritonKernel(self, name, num_warps, num_ctas, shared_mem_bytes, binary, ttir, *rest):  # noqa: N802
    return self._lib.TritonKernel(name, launch_warps(binary, num_warps), num_ctas,
                                  shared_mem_bytes, binary, "" if name in _lean_kernels else ttir,
                                  *rest)


def _ptxas_candidates() -> list[str]:
  """ptxas binaries XLA may assemble our PTX with: the CUDA compiler's pip packages beside jax's
  plugin, $CUDA_HOME / $CUDA_PATH, /usr/local/cuda and PATH (XLA's search covers these)."""
  found = []
  try:
    import nvidia  # namespace package of NVIDIA's pip wheels (cuda_nvcc, cu13)
    for root in nvidia.__path__:
      for sub in ("cu13/bin", "cuda_nvcc/bin"):
        found.append(os.path.join(root, sub, "ptxas"))
  except ImportError:
    pass
  for env in ("CUDA_HOME", "CUDA_PATH"):
    if os.environ.get(env):
      found.append(os.path.join(os.environ[env], "bin", "ptxas"))
  found += ["/usr/local/cuda/bin/ptxas", shutil.which("ptxas") or ""]
  return sorted({os.path.realpath(p) for p in found if p and os.access(p, os.X_OK)})


_PTXAS_RELEASE = re.compile(r"release (\d+\.\d+)")


@functools.lru_cache(maxsize=None)
def runtime_ptxas() -> tuple[str, int] | None:
  """The ptxas XLA may use that accepts the lowest PTX version, and that version (triton's
  numbering: 90 = PTX 9.0); None where none is found (triton's own choice then stands)."""
  from triton.backends.nvidia.compiler import ptx_get_version
  found = []
  for path in _ptxas_candidates():
    try:
      out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
      continue
    release = _PTXAS_RELEASE.search(out)
    if release:
      found.append((ptx_get_version(release.group(1)), path))
  if not found:
    return None
  version, path = min(found)
  return path, version


def runtime_ptx_options(options, arch: int):
  """`options` with ptx_version lowered to what the runtime's ptxas accepts (fix 7)."""
  from triton.backends.nvidia.compiler import get_ptx_version_from_options
  found = runtime_ptxas()
  if found is None or getattr(options, "ptx_version", "absent") == "absent":
    return options
  runtime = found[1]
  if get_ptx_version_from_options(options, arch) <= runtime:
    return options
  return dataclasses.replace(options, ptx_version=runtime)


def _install_shims(triton_lib):
  if getattr(triton_lib, "_ao_shims", False):
    return
  compile_ptx = triton_lib.compile_ttir_to_ptx_inplace
  compile_any = triton_lib.compile_ttir_inplace

  def compile_ttir_to_ptx_inplace(ttir, cuda_backend, cuda_options, capability):  # fixes 4, 5, 7
    options = runtime_ptx_options(cuda_options, capability)
    return compile_ptx(ttir, _GluonAwareStages(cuda_backend), options, capability)

  def compile_ttir_inplace(*args, **kwargs):  # fix 2 (calls the function above)
    return _scratch_as_operand(compile_any(*args, **kwargs))

  triton_lib.compile_ttir_to_ptx_inplace = compile_ttir_to_ptx_inplace
  triton_lib.compile_ttir_inplace = compile_ttir_inplace
  if triton_lib.triton_kernel_call_lib is not None:
    triton_lib.triton_kernel_call_lib = _KernelLib(triton_lib.triton_kernel_call_lib)
  triton_lib._ao_shims = True


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


def vary_over(x, axes):
  """x marked varying over every axis of `axes` it does not vary over yet (JAX's pcast; a
  no-op under check_vma=False)."""
  from jax import lax
  missing = tuple(sorted((a for a in axes if a not in varying_axes(x)), key=str))
  return lax.pcast(x, missing, to="varying") if missing else x
