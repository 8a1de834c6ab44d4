"""Several processes sharing one GPU run the fused kernels (marked gpu; skipped without a GPU).

The work is in tests/gpu_two_process.py (also runnable standalone); this
runs it and requires every check of its PASS/FAIL table to pass: every
scenario with two processes, the training step (impl="triton", then the
default config's first-call measurement) with four and eight.
"""
import os
import subprocess
import sys

import jax
import pytest

pytestmark = pytest.mark.gpu

if not any(d.platform == "gpu" for d in jax.devices()):
  pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

SCRIPT = os.path.join(os.path.dirname(__file__), "gpu_two_process.py")


@pytest.mark.parametrize("world, scenarios", [(2, None), (4, ("nested_step", "first_call")),
                                              (8, ("nested_step", "first_call"))])
def test_processes_share_one_gpu(world, scenarios):
  for scenario in scenarios or (None,):
    argv = [sys.executable, SCRIPT, "--world", str(world)]
    argv += ["--scenario", scenario] if scenario else []
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ALL PASS"), \
        proc.stdout[-6000:] + proc.stderr[-2000:]
