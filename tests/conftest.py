"""Shared test setup: 8 virtual CPU devices (set before jax is imported) and helpers."""
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

# GPU tests start subprocesses that share the GPUs with this process: let neither
# grab most of the memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Tests see only the shipped tuning data, never the developer's own benchmark verdicts.
os.environ["JAX_AUTOOVERLAP_CACHE_DIR"] = __import__("tempfile").mkdtemp(prefix="ao-cache-")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

TOL = {np.dtype("float32"): 2e-5, np.dtype(jax.numpy.bfloat16): 2e-2,
       np.dtype("float16"): 5e-3}


def rel_err(got, want) -> float:
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  assert np.all(np.isfinite(got)), "non-finite values in result"
  denom = np.linalg.norm(want)
  return float(np.linalg.norm(got - want) / (denom if denom else 1.0))


def assert_close(got, want, dtype, factor=1.0):
  tol = TOL[np.dtype(dtype)] * factor
  err = rel_err(got, want)
  assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


def cpu_mesh(shape, names):
  devices = jax.devices("cpu")
  need = int(np.prod(shape))
  if len(devices) < need:
    pytest.skip(f"needs {need} CPU devices")
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                       devices=devices[:need])


_seed = [0]


def forced_kernel_config():
  """The KernelConfig the GPU tests force: AO_TEST_ENGINE=tl|gluon runs the kernels on that
  engine (else the tuner's pick), AO_TEST_WG_PARTITIONS=1 with gluon the warpgroup-partition
  GEMM+RS (as tests/gpu_two_process.py --engine / --wg-partitions do)."""
  from jax_autooverlap.tuning.config import KernelConfig
  engine = os.environ.get("AO_TEST_ENGINE")
  wg = os.environ.get("AO_TEST_WG_PARTITIONS", "") == "1"
  if wg and engine != "gluon":
    raise ValueError("AO_TEST_WG_PARTITIONS=1 needs AO_TEST_ENGINE=gluon")
  return KernelConfig(engine=engine, wg_partitions=wg) if engine else None


def triton_config():
  """OverlapConfig forcing the GPU kernels on forced_kernel_config()."""
  import jax_autooverlap as ao
  return ao.OverlapConfig(impl="triton", kernel=forced_kernel_config())


def fresh_key():
  """A new PRNG key for every check: inputs are never reused between checks."""
  _seed[0] += 1
  return jax.random.key(1000 + _seed[0])


def randn(key, shape, dtype):
  return jax.random.normal(key, shape, np.float32).astype(dtype)


@pytest.fixture
def stand_in_cuda_driver(monkeypatch):
  """Planning a kernel sets up the symmetric workspace: here through a stand-in driver."""
  from fake_cuda import FakeDriver
  from jax_autooverlap.runtime import workspace
  monkeypatch.setattr(workspace, "REGISTRY", workspace.WorkspaceRegistry(driver=FakeDriver()))


def stand_in_kernels(monkeypatch) -> list:
  """Where a GPU kernel is planned, trace the unfused program instead (no GPU, no workspace).
  Returns the list of ("ag" | "rs", KernelConfig) of the kernel calls traced."""
  import dataclasses
  from jax_autooverlap.ops import registry
  calls = []
  for name, tag in (("ag_rows", "ag"), ("rs_rows", "rs")):
    impls = registry.core(name).impls
    unfused = impls["unfused"].run

    def run(a, b, cp, need_gathered, tag=tag, unfused=unfused):
      calls.append((tag, cp.gpu.kernel))
      return unfused(a, b, cp, need_gathered)

    monkeypatch.setitem(impls, "triton", dataclasses.replace(impls["triton"], run=run))
  return calls
