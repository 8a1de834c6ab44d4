"""The package imports its GPU toolchain correctly and the README demo runs."""
import os
import subprocess
import sys
import types


import jax_autooverlap as ao


def test_public_api():
  for name in ("jit", "explain", "ag_matmul", "matmul_rs", "OverlapConfig", "Report", "Match"):
    assert hasattr(ao, name), name


def test_jax_triton_imports_with_real_nvidia_backend():
  from jax_autooverlap._compat import import_jax_triton
  jt = import_jax_triton()
  import triton.backends.nvidia.driver as drv
  assert hasattr(drv, "TMA_TF32")
  from jax_triton import triton_lib
  assert not isinstance(triton_lib.cb, types.SimpleNamespace)  # the real backend, not the stub
  assert hasattr(triton_lib.cb, "CUDABackend")
  assert hasattr(jt, "triton_call")


def test_demo_runs_and_agrees():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "jax_autooverlap.demo"], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "OK: outputs agree" in proc.stdout
  assert "2 fused, 0 skipped" in proc.stdout
