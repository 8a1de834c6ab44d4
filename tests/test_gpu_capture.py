"""Fused kernels inside XLA's CUDA graphs, under default XLA flags (marked gpu; one GPU is enough).

XLA captures runs of >= 5 GPU ops (fusions, cuBLAS calls, custom calls), at top
level and in loop bodies, into CUDA graphs (command buffers).  A kernel launch
that allocates memory cannot be captured; ours allocate nothing (_compat.py,
"global scratch as an operand").  These checks run the real Triton kernels of
both fused ops, launched exactly as the fused ops launch them, on a one-GPU
mesh (world 1: the kernels' descriptors, tile counter, epoch and end-of-call
protocol run; no peer).  The 2-rank kernels in the same positions are checked
by the two-process tests (tests/test_gpu_multiprocess.py) and on two GPUs.

What one GPU cannot show: the old launch (jaxlib's per-launch scratch) also ran
in these positions on one H200 (2026-12-01, control run, default flags and with
CUSTOM_CALL command buffers and a graph size of 1), so there the failure it had
on 2xH200 (CUDA_ERROR_NOT_SUPPORTED, "Failed to create a child graph node":
CUDA refuses memory-allocation nodes in child graphs) does not occur; these
tests are regression tests of the new launch in every position, and the
2-GPU runs of the programs that failed before belong to the two-GPU issue.
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_autooverlap as ao
from conftest import assert_close, fresh_key, randn

pytestmark = pytest.mark.gpu

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
if not GPUS:
  pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

TRITON = ao.OverlapConfig(impl="triton")
M, K, N = 1024, 1024, 768


@pytest.fixture(autouse=True)
def default_xla_flags():
  """These tests are about XLA's defaults: no command-buffer flag may be set."""
  assert "command_buffer" not in os.environ.get("XLA_FLAGS", ""), os.environ["XLA_FLAGS"]


def _mesh():
  return jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=GPUS[:1])


def _ag(h, w):
  return lax.all_gather(h, "x", axis=0, tiled=True) @ w


def _rs(h, w):
  return lax.psum_scatter(h @ w, "x", scatter_dimension=0, tiled=True)


def _block(x, w1, w2, ag=_ag, rs=_rs):
  """Runs of >= 5 GPU ops (fusions, cuBLAS calls) around each kernel: XLA graphs such runs."""
  h = jnp.tanh(x * 1.5) + 0.25
  h = jnp.sin(h @ w1 @ w1.T) + h                                # 2 cuBLAS calls, fusions
  h = ag(h, w1)                                                 # AG+GEMM
  h = jax.nn.silu(h) * 0.5 + jnp.sin(h)
  h = jnp.cos(h @ w2 @ w2.T) * h                                # 2 cuBLAS calls, fusions
  y = rs(h, w2)                                                 # GEMM+RS
  y = jnp.exp(-jnp.abs(y @ w2.T @ w2)) + y * 2                  # 2 cuBLAS calls, fusions
  return y


def _inputs(dtype=jnp.bfloat16):
  k1, k2, k3 = jax.random.split(fresh_key(), 3)
  return (randn(k1, (M, K), dtype), (randn(k2, (K, N), np.float32) / np.sqrt(K)).astype(dtype),
          (randn(k3, (N, K), np.float32) / np.sqrt(N)).astype(dtype))


def _smap(fn, mesh):
  return jax.shard_map(fn, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=P("x"))


def _kernels_in(compiled_text):
  """Triton kernel launches in compiled HLO (the kernel's name is inside the compressed opaque)."""
  return compiled_text.count('custom_call_target="triton_kernel_call')


def test_kernels_among_gpu_ops_1000_runs_bit_identical():
  mesh = _mesh()
  fused = ao.jit(_smap(_block, mesh), overlap_config=TRITON)
  args = _inputs()
  assert all(m.fused and m.impl.startswith("triton") for m in fused.explain(*args))
  hlo = fused.lower(*args).compile().as_text()
  assert _kernels_in(hlo) == 2, "the two kernels are not in the compiled program"
  first = np.asarray(fused(*args))
  outs = [fused(*args) for _ in range(1000)]
  worst = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - first.astype(np.float32))))
              for o in outs[::50] + outs[-1:])
  assert worst == 0.0
  want = jax.jit(_smap(_block, mesh))(*args)
  assert_close(first, want, jnp.bfloat16)


def test_kernels_in_scan_body_and_nested_jits():
  mesh = _mesh()
  args = _inputs()
  want = np.asarray(jax.jit(_smap(_block, mesh))(*args), np.float32)

  def steps(block):
    def run(x, w1, w2):
      def step(c, i):
        return c + block(x * (1 + i.astype(x.dtype) / 64), w1, w2).astype(jnp.float32), None
      init = lax.pcast(jnp.zeros((M, K), jnp.float32), "x", to="varying")
      return lax.scan(step, init, jnp.arange(20))[0]
    return run

  scan_want = np.asarray(jax.jit(_smap(steps(_block), mesh))(*args))
  inner = ao.jit(_smap(_block, mesh), overlap_config=TRITON)

  direct = functools.partial(  # the fused ops called directly, inside a plain jax.jit
      _block, ag=lambda h, w: ao.ag_matmul(h, w, "x", config=TRITON),
      rs=lambda h, w: ao.matmul_rs(h, w, "x", config=TRITON))

  cases = {
      "jax.jit(ao.jit(f))": (jax.jit(inner), want),
      "ao.jit(scan body)": (ao.jit(_smap(steps(_block), mesh), overlap_config=TRITON), scan_want),
      "jax.jit(scan(ao.jit(f)))": (jax.jit(lambda *a: lax.scan(
          lambda c, i: (c + inner(a[0] * (1 + i.astype(a[0].dtype) / 64), *a[1:]).astype(
              jnp.float32), None), jnp.zeros((M, K), jnp.float32), jnp.arange(20))[0]), scan_want),
      "jax.jit(checkpoint(ao.jit(f)))": (jax.jit(jax.checkpoint(inner)), want),
      "jax.jit(f calling ao ops)": (jax.jit(_smap(direct, mesh)), want),
  }
  for where, (prog, ref) in cases.items():
    with jax.set_mesh(mesh):
      text = prog.lower(*args).compile().as_text()
      assert _kernels_in(text) >= 2, f"{where}: kernels not in the compiled program"
      first = np.asarray(prog(*args), np.float32)
      for _ in range(50):
        again = np.asarray(prog(*args), np.float32)
    np.testing.assert_array_equal(again, first, err_msg=where)
    assert_close(first, ref, jnp.bfloat16, factor=2.0)
