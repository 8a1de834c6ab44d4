"""fp8 operands of ao.ag_matmul / ao.matmul_rs: values against the f32 product of the
dequantized operands and against jax.jit's fp8 program, within the formats' tolerance
(jax_autooverlap/fp8.py); gradients against jax.grad of the unfused program; argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_autooverlap as ao
from conftest import cpu_mesh, fresh_key, rel_err
from jax_autooverlap import fp8

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
PAIRS = [(E4, E4), (E5, E4), (E4, E5)]
_ID = lambda p: f"{np.dtype(p[0]).name}x{np.dtype(p[1]).name}"
DN = (((1,), (0,)), ((), ()))


def quantized(key, shape, dtype, spread=4.0):
  """Random fp8 values over most of the format's range below 448 (e4m3's max)."""
  return (jax.random.normal(key, shape, np.float32) * spread).astype(dtype)


def dequantized_product(x, w, scale, dn=DN):
  """The f32 (here f64) product of the dequantized operands: the reference of an fp8 matmul."""
  x = np.asarray(x.astype(np.float32), np.float64)
  w = np.asarray(w.astype(np.float32), np.float64)
  return np.asarray(lax.dot_general(x, w, dn, precision=lax.Precision.HIGHEST)) * scale


def _run(mesh, body, in_specs, out_spec, *arrays, check_vma=True):
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                            check_vma=check_vma))
  return f(*(jax.device_put(a, NamedSharding(mesh, s)) if s is not None else a
             for a, s in zip(arrays, in_specs)))


def _scaled_dot(a, b, sa, sb, out_dtype, dn=DN):
  """What users write for a scaled fp8 matmul (and jax.jit runs as one fp8 GEMM)."""
  return (lax.dot_general(a, b, dn, preferred_element_type=jnp.float32) * (sa * sb)
          ).astype(out_dtype)


@pytest.mark.parametrize("pair", PAIRS, ids=_ID)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("impl", ["reference", "unfused"])
def test_ag_matmul_fp8_rows(pair, out_dtype, impl):
  mesh = cpu_mesh((4,), ("x",))
  k1, k2 = jax.random.split(fresh_key())
  k = 256
  x, w = quantized(k1, (4 * 16, k), pair[0]), quantized(k2, (k, 4 * 8), pair[1])
  sx, sw = jnp.float32(0.25), jnp.float32(3.0)
  specs = (P("x"), P(None, "x"), P(), P())
  cfg = ao.OverlapConfig(impl=impl, chunks=2)
  fused = lambda x, w, sx, sw: ao.ag_matmul(x, w, "x", preferred_element_type=out_dtype,
                                            scales=(sx, sw), config=cfg)
  program = lambda x, w, sx, sw: _scaled_dot(lax.all_gather(x, "x", axis=0, tiled=True), w, sx,
                                             sw, out_dtype)
  got = _run(mesh, fused, specs, P(None, "x"), x, w, sx, sw)
  want = _run(mesh, program, specs, P(None, "x"), x, w, sx, sw)
  assert got.dtype == want.dtype == out_dtype
  exact = dequantized_product(x, w, 0.75)
  tol = fp8.gemm_tolerance(k, out_dtype)
  assert rel_err(got, exact) <= tol
  assert rel_err(want, exact) <= tol
  assert tol < fp8.quantization_error(*pair)


@pytest.mark.parametrize("pair", PAIRS[:2], ids=_ID)
def test_ag_matmul_fp8_gathers_w_and_contracting_dim(pair):
  """The gather on w's columns (ag_rows through the canonical form) and on x's contracting
  dim (ag_k), with return_gathered: the gathered value is the fp8 bytes."""
  mesh = cpu_mesh((4,), ("x",))
  k1, k2 = jax.random.split(fresh_key())
  x, w = quantized(k1, (16, 256), pair[0]), quantized(k2, (256, 32), pair[1])
  sx, sw = jnp.float32(2.0), jnp.float32(0.5)
  cfg = ao.OverlapConfig(impl="reference", chunks=2)
  exact = dequantized_product(x, w, 1.0)

  def cols(x, w, sx, sw):  # x @ AG(w on its columns)
    return ao.ag_matmul(x, w, "x", gather_operand=1, gather_dim=1,
                        preferred_element_type=jnp.bfloat16, scales=(sx, sw), config=cfg)

  got = _run(mesh, cols, (P(), P(None, "x"), P(), P()), P(), x, w, sx, sw, check_vma=False)
  assert rel_err(got, exact) <= fp8.gemm_tolerance(256, jnp.bfloat16)

  def kdim(x, w, sx, sw):  # AG(x on K) @ w, and the gathered x
    return ao.ag_matmul(x, w, "x", gather_dim=1, preferred_element_type=jnp.float32,
                        scales=(sx, sw), return_gathered=True, config=cfg)

  out, g = _run(mesh, kdim, (P(None, "x"), P(), P(), P()), (P(), P()), x, w, sx, sw,
                check_vma=False)
  assert g.dtype == pair[0]
  assert np.array_equal(np.asarray(g, np.float32), np.asarray(x, np.float32))
  assert rel_err(out, exact) <= fp8.gemm_tolerance(256, jnp.float32)


@pytest.mark.parametrize("pair", PAIRS, ids=_ID)
@pytest.mark.parametrize("impl", ["reference", "unfused"])
def test_matmul_rs_fp8(pair, impl):
  mesh = cpu_mesh((4,), ("x",))
  k1, k2 = jax.random.split(fresh_key())
  k = 4 * 64
  x, w = quantized(k1, (32, k), pair[0]), quantized(k2, (k, 24), pair[1])
  sx, sw = jnp.float32(0.5), jnp.float32(0.5)
  specs = (P(None, "x"), P("x"), P(), P())
  cfg = ao.OverlapConfig(impl=impl, chunks=2)
  fused = lambda x, w, sx, sw: ao.matmul_rs(x, w, "x", preferred_element_type=jnp.bfloat16,
                                            scales=(sx, sw), config=cfg)
  program = lambda x, w, sx, sw: lax.psum_scatter(_scaled_dot(x, w, sx, sw, jnp.bfloat16), "x",
                                                  scatter_dimension=0, tiled=True)
  got = _run(mesh, fused, specs, P("x"), x, w, sx, sw)
  want = _run(mesh, program, specs, P("x"), x, w, sx, sw)
  exact = dequantized_product(x, w, 0.25)
  tol = fp8.gemm_tolerance(k // 4, jnp.bfloat16, partials=4)
  assert rel_err(got, exact) <= tol and rel_err(want, exact) <= tol


def _grad_case(op, pair):
  mesh = cpu_mesh((4,), ("x",))
  k1, k2, k3 = jax.random.split(fresh_key(), 3)
  x, w = quantized(k1, (32, 128), pair[0]), quantized(k2, (128, 32), pair[1])
  s = (jnp.float32(0.5), jnp.float32(1.5))
  cfg = ao.OverlapConfig(impl="reference")
  if op == "ag":
    specs, out = (P("x"), P(None, "x"), P(), P()), P(None, "x")
    fused = lambda x, w, sx, sw: ao.ag_matmul(x, w, "x", preferred_element_type=jnp.bfloat16,
                                              scales=(sx, sw), config=cfg)
    program = lambda x, w, sx, sw: _scaled_dot(lax.all_gather(x, "x", axis=0, tiled=True), w,
                                               sx, sw, jnp.bfloat16)
  else:
    specs, out = (P(None, "x"), P("x"), P(), P()), P("x")
    fused = lambda x, w, sx, sw: ao.matmul_rs(x, w, "x", preferred_element_type=jnp.bfloat16,
                                              scales=(sx, sw), config=cfg)
    program = lambda x, w, sx, sw: lax.psum_scatter(_scaled_dot(x, w, sx, sw, jnp.bfloat16), "x",
                                                    scatter_dimension=0, tiled=True)
  ct = jax.random.normal(k3, (32, 32), np.float32)

  def grads(body):
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, *s)

  return grads(fused), grads(program), (x, w, s, ct)


@pytest.mark.parametrize("pair", PAIRS[:2], ids=_ID)
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fp8_grads_match_jax_grad_of_the_unfused_program(op, pair):
  """The dual op computes what jax.grad of the unfused fp8 program computes (ops/scaled.py):
  the cotangent product against the dequantized operand, cast to the operand's fp8 dtype.
  JAX rounds per device before its psum_scatter, the dual sums in f32 and rounds once, so
  the two differ by fp8 roundings only; against the exact gradient the dual is within one
  rounding of the operand's format, and the scales' cotangents agree in f32."""
  got, want, (x, w, (sx, sw), ct) = _grad_case(op, pair)
  for g, u, operand in zip(got[:2], want[:2], (x, w)):
    assert g.dtype == u.dtype == operand.dtype
    assert rel_err(g, u) <= fp8.quantization_error(operand.dtype, operand.dtype)
  # exact gradients of sum(out * ct): ct @ w^T * s and x^T @ ct * s (ct rounded to bf16 as the
  # output's cotangent is)
  ct16 = np.asarray(ct.astype(jnp.bfloat16).astype(np.float32), np.float64)
  xf, wf = (np.asarray(v.astype(np.float32), np.float64) for v in (x, w))
  s = float(sx) * float(sw)
  exact_dx, exact_dw = ct16 @ wf.T * s, xf.T @ ct16 * s
  assert rel_err(got[0], exact_dx) <= 2 * fp8.unit_roundoff(x.dtype)
  assert rel_err(got[1], exact_dw) <= 2 * fp8.unit_roundoff(w.dtype)
  for g, u in zip(got[2:], want[2:]):
    np.testing.assert_allclose(float(g), float(u), rtol=1e-4)


def test_fp8_argument_checks():
  mesh = cpu_mesh((2,), ("x",))
  x8 = jnp.zeros((4, 64), E4)
  w8 = jnp.zeros((64, 8), E4)
  w16 = jnp.zeros((64, 8), jnp.bfloat16)

  def call(x, w, **kw):
    return _run(mesh, lambda x, w: ao.ag_matmul(x, w, "x", **kw), (P("x"), P()), P("x"), x, w)

  with pytest.raises(ValueError, match="must both be fp8"):
    call(x8, w16, preferred_element_type=jnp.bfloat16)
  with pytest.raises(ValueError, match="preferred_element_type"):
    call(x8, w8)
  with pytest.raises(ValueError, match="per-tensor"):
    call(x8, w8, preferred_element_type=jnp.bfloat16, scales=(jnp.ones((4,)), None))
  with pytest.raises(ValueError, match="apply to fp8"):
    call(x8.astype(jnp.bfloat16), w16, scales=(1.0, 1.0))
  out = call(x8, w8, preferred_element_type=jnp.float32, scales=(None, 2.0))
  assert out.dtype == np.float32


def test_tolerance_is_far_below_the_formats_error():
  for k in (1024, 4096, 8192):
    for partials in (1, 2, 8):
      assert fp8.gemm_tolerance(k, jnp.bfloat16, partials) < fp8.quantization_error(E4, E4)
  assert fp8.quantization_error(E4, E5) == 0.1875
  assert fp8.unit_roundoff(jnp.bfloat16) == 2.0 ** -8
