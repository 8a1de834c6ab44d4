"""Fused AllGather+GEMM Triton kernel on NVIDIA GPUs (marked gpu; skipped without 2 GPUs).

Every check draws fresh random inputs and compares with the unfused JAX
program (all_gather + dot_general, NCCL + cuBLAS).
"""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_autooverlap as ao
from conftest import assert_close, fresh_key, randn, triton_config

pytestmark = pytest.mark.gpu

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
if len(GPUS) < 2:
  pytest.skip("needs 2 NVIDIA GPUs", allow_module_level=True)

TRITON = triton_config()
TF32 = 5e-3  # tf32 products: relative error ~3e-4, summed over K


def _mesh():
  return jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=GPUS[:2])


def _pair(mesh, m_total, k, n_total, dtype):
  k1, k2 = jax.random.split(fresh_key())
  x = jax.device_put(randn(k1, (m_total, k), dtype), NamedSharding(mesh, P("x")))
  w = jax.device_put((randn(k2, (k, n_total), np.float32) / np.sqrt(k)).astype(dtype),
                     NamedSharding(mesh, P(None, "x")))
  return x, w


def _programs(mesh, config=TRITON):
  specs, out = (P("x"), P(None, "x")), P(None, "x")
  unfused = jax.jit(jax.shard_map(lambda x, w: lax.all_gather(x, "x", axis=0, tiled=True) @ w,
                                  mesh=mesh, in_specs=specs, out_specs=out))
  fused = ao.jit(jax.shard_map(lambda x, w: lax.all_gather(x, "x", axis=0, tiled=True) @ w,
                               mesh=mesh, in_specs=specs, out_specs=out), overlap_config=config)
  return unfused, fused


SHAPES = [(256, 1024, 512), (600, 1024, 1280), (2000, 2048, 2000), (4096, 8192, 8192),
          (16384, 8192, 28672)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, np.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_unfused(dtype, shape):
  if dtype == np.float32 and shape[0] * shape[2] > 4096 * 8192:
    pytest.skip("f32 checked on the smaller shapes")
  mesh = _mesh()
  unfused, fused = _programs(mesh)
  report = fused.explain(*_pair(mesh, *shape, dtype))
  assert report.matches[0].impl.startswith("triton kernel"), str(report)
  for _ in range(2):  # fresh inputs every check
    x, w = _pair(mesh, *shape, dtype)
    got, want = fused(x, w), unfused(x, w)
    if dtype == np.float32:
      assert_close(got, want, np.float32, factor=TF32 / 2e-5)
    else:
      assert_close(got, want, dtype)


@pytest.mark.parametrize("shape", [(600, 1024, 1280), (4096, 2048, 4096)], ids=str)
def test_every_element_written_and_gathered_returned(shape):
  from jax_autooverlap.backends import triton as tb
  from jax_autooverlap.tuning.select import default_kernel
  mesh = _mesh()
  m_total, k, n_total = shape
  x, w = _pair(mesh, m_total, k, n_total, jnp.bfloat16)

  def body(x, w):  # outputs zeroed before the launch: unwritten elements stay 0
    return tb.ag_gemm(x, w, axis_name="x", mesh=mesh, kernel=default_kernel(jnp.bfloat16),
                      out_dtype=jnp.bfloat16, return_gathered=True, timeout_s=10.0, poison=True)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(None, "x")),
                            out_specs=(P(None, "x"), P("x"))))
  out, gathered = f(x, w)
  unfused, _ = _programs(mesh)
  want = np.asarray(unfused(x, w), np.float32)
  got = np.asarray(out, np.float32)
  assert not np.any((got == 0) & (want != 0)), "kernel left output elements unwritten"
  assert_close(got, want, jnp.bfloat16)
  for dev in range(2):  # every device returns the whole gathered x
    np.testing.assert_array_equal(np.asarray(gathered[dev * m_total:(dev + 1) * m_total]),
                                  np.asarray(x))


def test_back_to_back_calls_and_scan_are_stable():
  mesh = _mesh()
  unfused, fused = _programs(mesh)
  x, w = _pair(mesh, 1024, 1024, 1024, jnp.bfloat16)
  first = fused(x, w)
  worst = jnp.zeros((), jnp.float32)
  for _ in range(10_000):
    worst = jnp.maximum(worst, jnp.max(jnp.abs(fused(x, w) - first).astype(jnp.float32)))
  assert float(worst) == 0.0, "repeated calls differ: a race in the kernel"
  assert_close(first, unfused(x, w), jnp.bfloat16)

  def steps(mm):
    def body(x, w):
      def step(acc, i):
        return acc + mm(x * (1 + i.astype(x.dtype) / 64), w).astype(jnp.float32), None
      init = lax.pcast(jnp.zeros((1024, 512), jnp.float32), "x", to="varying")
      return lax.scan(step, init, jnp.arange(100))[0]
    return body

  specs = (P("x"), P(None, "x"))
  ag = lambda x, w: lax.all_gather(x, "x", axis=0, tiled=True) @ w
  scan_f = ao.jit(jax.shard_map(steps(ag), mesh=mesh, in_specs=specs, out_specs=P(None, "x")),
                  overlap_config=TRITON)
  scan_u = jax.jit(jax.shard_map(steps(ag), mesh=mesh, in_specs=specs, out_specs=P(None, "x")))
  # Default XLA flags: ao.jit compiles with custom calls kept out of CUDA graphs, so the kernel
  # runs in the loop body too.  Graphs are instantiated on a program's second run: run it 3x.
  impl = scan_f.explain(x, w).matches[0].impl
  assert impl.startswith("triton kernel"), impl
  want = scan_u(x, w)
  for _ in range(3):
    assert_close(scan_f(x, w), want, jnp.bfloat16)


def test_kernel_among_many_ops_runs_repeatedly():
  """A fused op among >= 5 other GPU ops, which XLA turns into a CUDA graph by default."""
  mesh = _mesh()
  x, w = _pair(mesh, 2048, 1024, 2048, jnp.bfloat16)

  def block(x, w):  # fusion, kernel, then 3x (fusion, cuBLAS matmul), fusion
    h = lax.all_gather(x * 2 + 1, "x", axis=0, tiled=True) @ w
    for _ in range(3):
      h = (jax.nn.gelu(h) @ w) / 32
    return h

  kw = dict(mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))
  unfused, fused = jax.jit(jax.shard_map(block, **kw)), ao.jit(jax.shard_map(block, **kw),
                                                               overlap_config=TRITON)
  assert fused.explain(x, w).matches[0].impl.startswith("triton kernel")
  want = unfused(x, w)
  for _ in range(3):  # graphs are instantiated on a program's second run
    assert_close(fused(x, w), want, jnp.bfloat16)
  # Inside an outer jax.jit the outer program is compiled with XLA's own flags: unfused there.
  auto = ao.jit(jax.shard_map(block, **kw))
  outer = jax.jit(lambda x, w: auto(x, w) + 0)
  for _ in range(3):
    assert_close(outer(x, w), want, jnp.bfloat16)


_SUBPROCESS_PRELUDE = """
import os, sys
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_autooverlap as ao
gpus = [d for d in jax.devices() if d.platform == "gpu"][:2]
mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpus)
x = jax.device_put(jax.random.normal(jax.random.key(1), (1024, 1024), jnp.bfloat16), NamedSharding(mesh, P("x")))
w = jax.device_put(jax.random.normal(jax.random.key(2), (1024, 1024), jnp.bfloat16), NamedSharding(mesh, P(None, "x")))
"""


def _run(script, env_extra=None, timeout=300):
  env = dict(os.environ, **(env_extra or {}))
  src = textwrap.dedent(_SUBPROCESS_PRELUDE.format(tests=os.path.dirname(__file__))) + textwrap.dedent(script)
  return subprocess.run([sys.executable, "-c", src], env=env, capture_output=True, text=True,
                        timeout=timeout)


def test_command_buffers_off():
  proc = _run("""
  cfg = ao.OverlapConfig(impl="triton")
  ag = lambda x, w: lax.all_gather(x, "x", axis=0, tiled=True) @ w
  f = ao.jit(jax.shard_map(ag, mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")), overlap_config=cfg)
  u = jax.jit(jax.shard_map(ag, mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")))
  first = f(x, w)
  worst = jnp.zeros((), jnp.float32)
  for _ in range(10_000):
    worst = jnp.maximum(worst, jnp.max(jnp.abs(f(x, w) - first).astype(jnp.float32)))
  want = np.asarray(u(x, w), np.float32)
  err = np.linalg.norm(np.asarray(first, np.float32) - want) / np.linalg.norm(want)
  def steps(mm):
    def body(x, w):
      def step(acc, i):
        return acc + mm(x * (1 + i.astype(x.dtype) / 64), w).astype(jnp.float32), None
      init = lax.pcast(jnp.zeros((1024, 512), jnp.float32), "x", to="varying")
      return lax.scan(step, init, jnp.arange(100))[0]
    return body
  sf = ao.jit(jax.shard_map(steps(ag), mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")), overlap_config=cfg)
  su = jax.jit(jax.shard_map(steps(ag), mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")))
  print("SCAN_IMPL", sf.explain(x, w).matches[0].impl)
  a, b = np.asarray(sf(x, w)), np.asarray(su(x, w))
  print("RESULT", float(worst), err, float(np.linalg.norm(a - b) / np.linalg.norm(b)))
  """, {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "SCAN_IMPL triton kernel" in proc.stdout, proc.stdout[-2000:]
  worst, err, scan_err = map(float, proc.stdout.split("RESULT")[1].split())
  assert worst == 0.0 and err < 2e-2 and scan_err < 2e-2


def check_missing_peer(fused_call: str, zeros_shape, specs: str, op_name: str, prelude=""):
  """Only rank 0 runs the fused op (inside lax.cond): its bounded waits must expire, the call
  must fail loudly, and check_errors() must name the op, the ranks and the chunk.  (The op is
  called directly under jax.jit: XLA_FLAGS must keep custom calls out of CUDA graphs.)"""
  proc = _run(prelude + f"""
from jax_autooverlap.runtime import check_errors, CollectiveTimeoutError
cfg = ao.OverlapConfig(impl="triton", timeout_s=2.0)
def body(x, w):
  return lax.cond(lax.axis_index("x") == 0, lambda: {fused_call},
                  lambda: lax.pcast(jnp.zeros({zeros_shape}, jnp.bfloat16), "x", to="varying"))
f = jax.jit(jax.shard_map(body, mesh=mesh, {specs}))
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
""", {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN"}, timeout=240)
  out = proc.stdout
  assert "TIMEOUT:" in out, out[-3000:] + proc.stderr[-1500:]
  assert "XLA ERROR:" in out, out  # the failing call itself raised: no silent garbage
  assert f"{op_name} over axis 'x'" in out and "from peer rank 1" in out, out


def test_missing_peer_times_out_with_error():
  check_missing_peer('ao.ag_matmul(x, w, "x", config=cfg)', (1024, 512),
                     'in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")', "ag_matmul")
