"""Two processes sharing one GPU run the fused kernels (marked gpu; skipped without a GPU).

The work is in tests/gpu_two_process.py (also runnable standalone); this
runs it and requires every check of its PASS/FAIL table to pass.
"""
import os
import subprocess
import sys

import jax
import pytest

pytestmark = pytest.mark.gpu

if not any(d.platform == "gpu" for d in jax.devices()):
  pytest.skip("needs an NVIDIA GPU", allow_module_level=True)


def test_two_processes_share_one_gpu():
  script = os.path.join(os.path.dirname(__file__), "gpu_two_process.py")
  proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=2000)
  assert proc.returncode == 0 and "ALL PASS" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-2000:]
