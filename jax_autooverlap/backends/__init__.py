"""Backends: the one call site of the Triton kernels (jax-triton) and their host-side set-up."""
import importlib

_KERNEL_MODULES = ("ag_gemm", "gemm_rs", "split_k", "gluon_ag_gemm", "gluon_gemm", "gluon_gemm_rs")


def load_kernels() -> None:
  """Import jax-triton and every kernel module.  Call it before lowering fused programs in
  several threads at once: Triton's modules import each other in cycles, so a first import
  racing in two threads hands one of them a half-initialised module ("module 'triton' has no
  attribute 'runtime'", seen on the GPU in a first call's concurrent compiles)."""
  from jax_autooverlap._compat import import_jax_triton
  import_jax_triton()
  for name in _KERNEL_MODULES:
    importlib.import_module(f"jax_autooverlap.kernels.{name}")
