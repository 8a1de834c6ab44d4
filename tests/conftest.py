"""Shared test setup: 8 virtual CPU devices (set before jax is imported) and helpers, among
them the checks the two-GPU tests of both ops make (test_gpu_ag.py, test_gpu_rs.py)."""
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

# GPU tests start subprocesses that share the GPUs with this process: let neither
# grab most of the memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Tests see only the shipped tuning data, never the developer's own benchmark verdicts.
os.environ["JAX_AUTOOVERLAP_CACHE_DIR"] = __import__("tempfile").mkdtemp(prefix="ao-cache-")

import inspect  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax import lax  # noqa: E402

from gpu_config import forced_kernel_config  # noqa: E402

TOL = {np.dtype("float32"): 2e-5, np.dtype(jnp.bfloat16): 2e-2,
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


def notebook_cell(marker: str) -> str:
  """The source of notebooks/explore.ipynb's code cell that contains `marker`."""
  import json
  import pathlib
  nb = json.loads((pathlib.Path(__file__).parents[1] / "notebooks" / "explore.ipynb").read_text())
  return next("".join(c["source"]) for c in nb["cells"]
              if c["cell_type"] == "code" and marker in "".join(c["source"]))


def cpu_mesh(shape, names):
  devices = jax.devices("cpu")
  need = int(np.prod(shape))
  if len(devices) < need:
    pytest.skip(f"needs {need} CPU devices")
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                       devices=devices[:need])


_seed = [0]


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

    def run(a, b, cp, need_gathered, scale=None, tag=tag, unfused=unfused):
      calls.append((tag, cp.gpu.kernel))
      return unfused(a, b, cp, need_gathered, scale)

    monkeypatch.setitem(impls, "triton", dataclasses.replace(impls["triton"], run=run))
  return calls


# --- checks the two-GPU tests of both ops share -----------------------------------------------

def assert_repeat_calls_identical(f, args, calls=10_000):
  """`calls` more calls of f(*args) return the first call's bits (a race in a kernel, or a
  non-deterministic reduction, would not); the first result.  The differences are reduced on
  the device, so the calls are not held up by a host round trip each."""
  first = f(*args)
  worst = jnp.zeros((), jnp.float32)
  for _ in range(calls):
    worst = jnp.maximum(worst, jnp.max(jnp.abs(f(*args) - first).astype(jnp.float32)))
  assert float(worst) == 0.0, "repeated calls differ: a race or a non-deterministic reduction"
  return first


def scan_body(op, init_shape, steps=100):
  """A shard_map body over axis "x": the f32 sum over i < steps of op(x * (1 + i/64), w), each
  step a lax.scan iteration (the fused op inside a loop body)."""
  def body(x, w):
    def step(acc, i):
      return acc + op(x * (1 + i.astype(x.dtype) / 64), w).astype(jnp.float32), None
    init = lax.pcast(jnp.zeros(init_shape, jnp.float32), "x", to="varying")
    return lax.scan(step, init, jnp.arange(steps))[0]
  return body


def assert_scan_runs_the_kernel(op, init_shape, args, config, **shard_map_kw):
  """ao.jit of scan_body(op) runs the GPU kernel in the loop body and matches jax.jit's, three
  runs.  Default XLA flags: ao.jit compiles with custom calls kept out of CUDA graphs, which
  XLA instantiates on a program's second run."""
  import jax_autooverlap as ao
  body = scan_body(op, init_shape)
  fused = ao.jit(jax.shard_map(body, **shard_map_kw), overlap_config=config)
  impl = fused.explain(*args).matches[0].impl
  assert impl.startswith("triton kernel"), impl
  want = jax.jit(jax.shard_map(body, **shard_map_kw))(*args)
  for _ in range(3):
    assert_close(fused(*args), want, jnp.bfloat16)


_TWO_GPU_PRELUDE = """
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_autooverlap as ao
gpus = [d for d in jax.devices() if d.platform == "gpu"][:2]
mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpus)
x = jax.device_put(jax.random.normal(jax.random.key(1), (1024, 1024), jnp.bfloat16),
                   NamedSharding(mesh, {x_spec}))
w = jax.device_put(jax.random.normal(jax.random.key(2), (1024, 1024), jnp.bfloat16),
                   NamedSharding(mesh, {w_spec}))
"""


def run_on_two_gpus(script: str, x_spec: str, w_spec: str, xla_flags: str, timeout=300):
  """Python source `script` in a new process (XLA reads its flags once, at start-up) with
  XLA_FLAGS=xla_flags, after a prelude that defines `mesh` over two GPUs (axis "x") and bf16
  x, w [1024, 1024] placed as the PartitionSpec sources x_spec, w_spec."""
  src = (textwrap.dedent(_TWO_GPU_PRELUDE.format(x_spec=x_spec, w_spec=w_spec))
         + textwrap.dedent(script))
  return subprocess.run([sys.executable, "-c", src], env=dict(os.environ, XLA_FLAGS=xla_flags),
                        capture_output=True, text=True, timeout=timeout)


def check_command_buffers_off(op: str, x_spec: str, w_spec: str, out_spec: str, init_shape):
  """With XLA's command buffers off: assert_repeat_calls_identical on the fused op, its first
  result close to the unfused program's, and scan_body(op) running the kernel and matching.
  op: source of a function of x and w; specs: PartitionSpec sources."""
  helpers = "".join(inspect.getsource(f) + "\n" for f in (assert_repeat_calls_identical, scan_body))
  proc = run_on_two_gpus(helpers + f"""
op = {op}
kw = dict(mesh=mesh, in_specs=({x_spec}, {w_spec}), out_specs={out_spec})
cfg = ao.OverlapConfig(impl="triton")
first = assert_repeat_calls_identical(ao.jit(jax.shard_map(op, **kw), overlap_config=cfg), (x, w))
want = np.asarray(jax.jit(jax.shard_map(op, **kw))(x, w), np.float32)
err = np.linalg.norm(np.asarray(first, np.float32) - want) / np.linalg.norm(want)
body = scan_body(op, {tuple(init_shape)})
sf = ao.jit(jax.shard_map(body, **kw), overlap_config=cfg)
print("SCAN_IMPL", sf.explain(x, w).matches[0].impl)
a, b = np.asarray(sf(x, w)), np.asarray(jax.jit(jax.shard_map(body, **kw))(x, w))
print("RESULT", err, float(np.linalg.norm(a - b) / np.linalg.norm(b)))
""", x_spec, w_spec, "--xla_gpu_enable_command_buffer=")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "SCAN_IMPL triton kernel" in proc.stdout, proc.stdout[-2000:]
  err, scan_err = map(float, proc.stdout.split("RESULT")[1].split())
  assert err < 2e-2 and scan_err < 2e-2


def check_missing_peer(fused_call: str, zeros_shape, x_spec: str, w_spec: str, out_spec: str,
                       op_name: str):
  """Only rank 0 runs the fused op (source `fused_call`, inside lax.cond): its bounded waits
  must expire, the call must fail loudly, and check_errors() must name the op, the ranks and
  the chunk.  (The op is called directly under jax.jit: XLA_FLAGS must keep custom calls out
  of CUDA graphs.)"""
  proc = run_on_two_gpus(f"""
from jax_autooverlap.runtime import check_errors, CollectiveTimeoutError
cfg = ao.OverlapConfig(impl="triton", timeout_s=2.0)
def body(x, w):
  return lax.cond(lax.axis_index("x") == 0, lambda: {fused_call},
                  lambda: lax.pcast(jnp.zeros({zeros_shape}, jnp.bfloat16), "x", to="varying"))
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=({x_spec}, {w_spec}), out_specs={out_spec}))
try:
  with ao.runtime.context.use_mesh(mesh):
    jax.block_until_ready(f(x, w))
  print("NO ERROR")
except Exception as e:
  print("XLA ERROR:", type(e).__name__, str(e)[:300])
try:
  check_errors()
  print("NO RECORD")
except CollectiveTimeoutError as e:
  print("TIMEOUT:", e)
""", x_spec, w_spec, "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN", timeout=240)
  out = proc.stdout
  assert "TIMEOUT:" in out, out[-3000:] + proc.stderr[-1500:]
  assert "XLA ERROR:" in out, out  # the failing call itself raised: no silent garbage
  assert f"{op_name} over axis 'x'" in out and "from peer rank 1" in out, out
