"""fp8 fused kernels on ONE GPU, in loopback (marked gpu; skipped without an NVIDIA GPU).

Rank 0 of a group of two whose peer is a second buffer on the same GPU (bench/loopback):
both ops on both engines with e4m3 x e4m3, e5m2 x e4m3 and e4m3 x e5m2 operands (b K-major),
the epilogue scale from the table.  The output is checked against the f32 product of the
dequantized operands within the formats' tolerance (jax_autooverlap/fp8.py), and against
XLA's own fp8 GEMM of the same local work within twice that; outputs are poisoned (zeroed
before the launch: an element the kernel does not write fails); the push must be what the
peer needs; a second call (other parity slot) bit-identical.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_autooverlap import fp8
from jax_autooverlap.bench import common
from jax_autooverlap.bench import loopback as lb
from jax_autooverlap.bench.loopback.cli import max_rel_err
from jax_autooverlap.bench.loopback.programs import gemm_program

pytestmark = pytest.mark.gpu

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
if not GPUS:
  pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
if str(getattr(GPUS[0], "compute_capability", "")) != "9.0":
  pytest.skip("fp8 wgmma kernels are for sm_90", allow_module_level=True)

ENGINES = ["tl", "gluon"]
E4, E5 = "float8_e4m3fn", "float8_e5m2"
# (op, shape, a's format, b's): e4m3 x e4m3 on ragged tiles and a reference shape, the mixed
# pairings (a backward's e5m2 gradient times e4m3 weights, and the other way) on ragged tiles
CASES = [(op, shape, E4, E4) for op, shape in (
    ("ag", (600, 1024, 1280)), ("ag", (4096, 8192, 8192)), ("rs", (1200, 1024, 1280)),
    ("rs", (4096, 8192, 8192)))]
CASES += [(op, shape, a, b) for op, shape in (("ag", (600, 1024, 1280)), ("rs", (1200, 1024, 1280)))
          for a, b in ((E5, E4), (E4, E5))]


def _sms():
  from jax_autooverlap.runtime import cuda
  return cuda.sm_count(GPUS[0].local_hardware_id)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-"
                         f"{fp8.short(c[2])}x{fp8.short(c[3])}")
def test_fp8_loopback_matches_the_dequantized_product(engine, case):
  """Output within the formats' tolerance of the f32 product of the dequantized operands
  (poisoned: every element written), the push what the peer needs, a bit-identical repeat;
  GEMM+RS on the Gluon engine also with a consumer partition per warpgroup (large shape)."""
  op, (m, k, n), a_dtype, b_dtype = case
  case = lb.Case(op, m, k, n, dtype=a_dtype, b_dtype=b_dtype)
  loop = lb.Loopback(case, GPUS[0], seed=m + k + n)
  cfg = lb.kernel_configs(case, GPUS[0].device_kind, [engine])[engine]
  assert cfg.block_k == 128
  variants = [cfg] + ([dataclasses.replace(cfg, wg_partitions=True)]
                      if op == "rs" and engine == "gluon" and m == 4096 else [])
  tol = max_rel_err(case)
  for kernel in variants:
    res = loop.check(lb.fused_program(case, kernel, _sms(), poison=True))
    assert res["rel_err"] <= tol, res
    assert res["push_rel_err"] <= (0.0 if op == "ag" else tol), res  # ag pushes fp8 bytes
    assert res["bit_identical_repeat"], res


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fp8_loopback_within_the_formats_error_of_xlas_fp8_gemm(engine, op):
  """The same local work through XLA's fp8 GEMM (cuBLASLt), its result scaled as ours:
  both are within the tolerance of the exact product, so within twice it of each other."""
  case = lb.Case(op, 4096, 8192, 8192, dtype="float8_e4m3fn")
  loop = lb.Loopback(case, GPUS[0], seed=5)
  cfg = lb.kernel_configs(case, GPUS[0].device_kind, [engine])[engine]
  ours = np.asarray(lb.fused_program(case, cfg, _sms())(*loop.fused_args()), np.float32)
  xla = np.asarray(gemm_program(case)(*loop.gemm_args()), np.float32) * case.scale
  if op == "rs":  # rank 0's rows: its own partial plus the peer's
    xla = xla[:case.m // 2] + np.asarray(loop.peers[0], np.float32)
  assert common.rel_err(ours, xla) <= 2 * max_rel_err(case)


@pytest.mark.parametrize("engine", ENGINES)
def test_fp8_loopback_ag_gathers_fp8_bytes(engine):
  """return_gathered: the gathered shards are the fp8 bytes, own shard first, then the peer's."""
  from jax_autooverlap.runtime.errors import check_errors
  case = lb.Case("ag", 600, 1024, 1280, dtype="float8_e4m3fn")
  loop = lb.Loopback(case, GPUS[0], seed=3)
  cfg = lb.kernel_configs(case, GPUS[0].device_kind, [engine])[engine]
  program = lb.fused_program(case, cfg, _sms(), return_gathered=True, poison=True)
  want = np.concatenate([np.asarray(loop.a), np.asarray(loop.peers[0])])
  for _ in range(2):
    _, gathered = program(*loop.fused_args())
    check_errors()
    assert gathered.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(gathered).view(np.uint8), want.view(np.uint8))


def test_fp8_gluon_engine_alone_matches_the_dequantized_product():
  from jax_autooverlap.bench.loopback.programs import engine_program
  case = lb.Case("ag", 4096, 8192, 8192, dtype="float8_e4m3fn")
  loop = lb.Loopback(case, GPUS[0], seed=9)
  cfg = lb.kernel_configs(case, GPUS[0].device_kind, ["gluon"])["gluon"]
  a, b = loop.gemm_args()
  got = engine_program(cfg, _sms(), out_dtype=jnp.bfloat16)(a, b)
  want = np.asarray(a, np.float32) @ np.asarray(b, np.float32).T
  assert common.rel_err(got, want) <= fp8.gemm_tolerance(case.k, jnp.bfloat16)
