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


# --- the rewrite: fp8 forms next to an all_gather / psum_scatter ----------------------------

def qdq(x, scale, dtype=E4):
  """Quantize-dequantize with a per-tensor scale, as Flax's fp8_ops.qdq writes it."""
  top = jnp.finfo(dtype).max.astype(x.dtype)
  q = jnp.clip(x / scale.astype(x.dtype), -top, top).astype(dtype)
  return q.astype(x.dtype) * scale.astype(x.dtype)


def _rewrite(body, in_specs, out_specs, args, mesh=None, check_vma=True):
  """(report, ao.jit's result, jax.jit's result) of a shard_map body, reference ring."""
  mesh = mesh or cpu_mesh((4,), ("x",))
  f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                    check_vma=check_vma)
  fused = ao.jit(f, overlap_config=ao.OverlapConfig(impl="reference"))
  return fused.explain(*args), fused(*args), jax.jit(f)(*args), fused


def _bf16(key, shape, scale=1.0):
  return (jax.random.normal(key, shape, np.float32) * scale).astype(jnp.bfloat16)


AG_SPECS = (P("x"), P(None, "x"), P(), P())


def _ag_args():
  k1, k2 = jax.random.split(fresh_key())
  return _bf16(k1, (64, 256), 2.0), _bf16(k2, (256, 64), 0.1), jnp.float32(0.01), \
      jnp.float32(0.002)


def test_rewrite_ag_quantize_after_gather_delayed_scaling():
  """all_gather(x) -> qdq (scale an input: delayed scaling) -> matmul: the shard is quantized
  before the gather, e4m3 bytes are gathered, one fp8 GEMM; what jax.jit computes within the
  formats' tolerance; the compiled program keeps no all-gather of the 16-bit value."""
  def body(x, w, sx, sw):
    return qdq(lax.all_gather(x, "x", axis=0, tiled=True), sx) @ qdq(w, sw)

  report, got, want, fused = _rewrite(body, AG_SPECS, P(None, "x"), _ag_args())
  (m,) = report.matches
  assert m.status == "fused" and m.kind == "ag_matmul" and m.dtype == "e4m3xe4m3->bfloat16"
  assert "quantized before the gather" in m.note and "e4m3 bytes" in m.note
  assert rel_err(got, want) <= fp8.gemm_tolerance(256, jnp.bfloat16)
  hlo = fused.lower(*_ag_args()).compile().as_text()
  assert "all-gather" not in hlo  # the ring's ppermutes move the fp8 shard


def test_rewrite_ag_current_scaling_reduces_the_amax_over_the_group():
  """The scale from the gathered value's amax (current scaling): the amax becomes the pmax of
  the shards' amaxes, so the 16-bit gather goes."""
  def body(x, w, sx, sw):
    g = lax.all_gather(x, "x", axis=0, tiled=True)
    s = jnp.max(jnp.abs(g)).astype(jnp.float32) / 448.0
    return qdq(g, s) @ qdq(w, sw)

  args = _ag_args()
  report, got, want, fused = _rewrite(body, AG_SPECS, P(None, "x"), args)
  (m,) = report.matches
  assert m.status == "fused" and "amax is the max over 'x'" in m.note
  assert rel_err(got, want) <= fp8.gemm_tolerance(256, jnp.bfloat16)
  hlo = fused.lower(*args).compile().as_text()
  assert "all-gather" not in hlo and "all-reduce" in hlo


def test_rewrite_ag_direct_fp8_and_dequantized_before_the_gather():
  """The direct form (gather of an fp8 value, dot_general of fp8 operands, the scales applied
  to the result) and a dequantized shard gathered (its fp8 source is gathered instead)."""
  k1, k2 = jax.random.split(fresh_key())
  q, qw = quantized(k1, (64, 256), E4), quantized(k2, (256, 64), E4, 0.5)
  s = jnp.float32(0.01)

  def direct(q, qw, s):
    g = lax.all_gather(q, "x", axis=0, tiled=True)
    return (lax.dot_general(g, qw, DN, preferred_element_type=jnp.float32) * s
            ).astype(jnp.bfloat16)

  report, got, want, _ = _rewrite(direct, (P("x"), P(None, "x"), P()), P(None, "x"), (q, qw, s))
  assert [m.status for m in report.matches] == ["fused"]
  assert "gather moves e4m3 bytes" in report.matches[0].note
  assert rel_err(got, want) <= fp8.gemm_tolerance(256, jnp.bfloat16)

  def before(x, w, sx, sw):
    return lax.all_gather(qdq(x, sx), "x", axis=0, tiled=True) @ qdq(w, sw)

  report, got, want, _ = _rewrite(before, AG_SPECS, P(None, "x"), _ag_args())
  (m,) = report.matches
  assert m.status == "fused" and "source of the dequantized shard" in m.note
  assert m.dtype == "e4m3xe4m3->bfloat16"
  assert rel_err(got, want) <= fp8.gemm_tolerance(256, jnp.bfloat16)


def test_rewrite_rs_fp8_forms():
  """matmul -> psum_scatter in both forms: qdq operands, and an fp8 dot_general scaled before
  the scatter; the partial products are summed in bf16 (explain says so)."""
  k1, k2 = jax.random.split(fresh_key())
  x, w = _bf16(k1, (64, 256), 2.0), _bf16(k2, (256, 64), 0.1)
  sx, sw = jnp.float32(0.01), jnp.float32(0.002)
  specs = (P(None, "x"), P("x"), P(), P())

  def qdq_rs(x, w, sx, sw):
    return lax.psum_scatter(qdq(x, sx) @ qdq(w, sw), "x", scatter_dimension=0, tiled=True)

  def direct_rs(x, w, sx, sw):
    q, qw = (x / sx.astype(x.dtype)).astype(E5), (w / sw.astype(w.dtype)).astype(E4)
    y = lax.dot_general(q, qw, DN, preferred_element_type=jnp.bfloat16)
    return lax.psum_scatter(y * (sx * sw).astype(jnp.bfloat16), "x", scatter_dimension=0,
                            tiled=True)

  for body, dtypes in ((qdq_rs, "e4m3xe4m3"), (direct_rs, "e5m2xe4m3")):
    report, got, want, _ = _rewrite(body, specs, P("x"), (x, w, sx, sw))
    (m,) = report.matches
    assert m.status == "fused" and m.kind == "matmul_rs"
    assert m.dtype == f"{dtypes}->bfloat16"
    assert "summed in bfloat16" in m.note and "never in fp8" in m.note
    assert rel_err(got, want) <= fp8.gemm_tolerance(64, jnp.bfloat16, partials=4)


def test_rewrite_skips_scales_that_are_not_per_tensor_and_half_fp8_matmuls():
  k1, k2 = jax.random.split(fresh_key())
  x, w = _bf16(k1, (64, 256)), _bf16(k2, (256, 64))
  s = jnp.float32(0.01)

  def row_scaled(x, w, s):  # per-row scales of the gathered activations
    g = lax.all_gather(x, "x", axis=0, tiled=True)
    r = jnp.max(jnp.abs(g), axis=1, keepdims=True) / 448
    return ((g / r).astype(E4).astype(jnp.bfloat16) * r) @ qdq(w, s)

  def one_fp8(x, w, s):  # fp8 activations, 16-bit weights
    g = lax.all_gather((x / s.astype(x.dtype)).astype(E4), "x", axis=0, tiled=True)
    return lax.dot_general(g, w, DN, preferred_element_type=jnp.bfloat16)

  def rs_row_scaled(x, w, s):  # an fp8 product scaled per row before the scatter
    q, qw = x.astype(E4), w.astype(E4)
    y = lax.dot_general(q, qw, DN, preferred_element_type=jnp.bfloat16)
    r = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    return lax.psum_scatter(y * r, "x", scatter_dimension=0, tiled=True)

  for body, specs, out, code in (
      (row_scaled, (P("x"), P(None, "x"), P()), P(None, "x"), "fp8_scale_layout"),
      (one_fp8, (P("x"), P(None, "x"), P()), P(None, "x"), "fp8_one_operand"),
      (rs_row_scaled, (P(None, "x"), P("x"), P()), P("x"), "fp8_scale_layout")):
    report, got, want, _ = _rewrite(body, specs, out, (x, w, s))
    (m,) = report.matches
    assert m.status == "skipped" and m.code == code, (body.__name__, m)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _flax_body(x, w1, w2, s, h):
  """A sequence-parallel MLP block with Flax's fp8 dot (fp8_ops.fp8_scaled_dot_general: e4m3
  forward, e5m2 gradients, delayed scaling from amax histories)."""
  from flax.linen import fp8_ops
  def dot(a, b, i):
    return fp8_ops.fp8_scaled_dot_general(
        a, b, DN, preferred_element_type=jnp.bfloat16, lhs_scale=s[i], rhs_scale=s[i + 1],
        grad_scale=s[i + 2], lhs_amax_history=h[i], rhs_amax_history=h[i + 1],
        grad_amax_history=h[i + 2], quantize_compute_type=jnp.bfloat16)
  g = lax.all_gather(x, "x", axis=0, tiled=True)
  z = dot(jax.nn.relu(dot(g, w1, 0)), w2, 3)
  return lax.psum_scatter(z, "x", scatter_dimension=0, tiled=True)


def test_rewrite_flax_fp8_ops_forward_and_backward():
  """Flax's fp8 ops in a TP+SP block under jax.grad: forward AG+GEMM and GEMM+RS in e4m3, and
  the backward's AG+GEMM and GEMM+RS in e5m2 x e4m3 (Flax quantizes the gradients), all four
  fused; gradients as jax.grad's within the fp8 formats' error.  Without differentiation the
  custom_vjp-wrapped forward is matched as well."""
  pytest.importorskip("flax")
  mesh = cpu_mesh((4,), ("x",))
  f = jax.shard_map(_flax_body, mesh=mesh, in_specs=(P("x"), P(None, "x"), P("x"), P(), P()),
                    out_specs=P("x"), check_vma=False)
  k = jax.random.split(fresh_key(), 3)
  args = (_bf16(k[0], (64, 128)), _bf16(k[1], (128, 256), 0.1), _bf16(k[2], (256, 128), 0.1),
          jnp.full((6, 1), 0.01, jnp.float32), jnp.full((6, 16), 4.0, jnp.float32))
  loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)
  fused = ao.jit(loss, overlap_config=ao.OverlapConfig(impl="reference"))
  step = jax.jit(jax.grad(fused, argnums=(0, 1, 2)))
  rows = [(m.phase, m.kind, m.status, m.dtype) for m in ao.explain(step, *args).matches]
  assert rows == [("fwd", "ag_matmul", "fused", "e4m3xe4m3->bfloat16"),
                  ("fwd", "matmul_rs", "fused", "e4m3xe4m3->bfloat16"),
                  ("bwd", "ag_matmul", "fused", "e5m2xe4m3->bfloat16"),
                  ("bwd", "matmul_rs", "fused", "e5m2xe4m3->bfloat16")]
  want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
  for g, u in zip(step(*args), want):
    assert rel_err(g, u) <= fp8.quantization_error(E5, E4)
  primal = [(m.kind, m.status) for m in ao.explain(fused, *args).matches]
  assert primal == [("ag_matmul", "fused"), ("matmul_rs", "fused")]


def test_rewrite_explicit_sharding_fp8():
  """Programs without shard_map: a dequantized sequence shard gathered by a reshard, a gather
  implied by a matmul's out_sharding, a row-parallel matmul reduce-scattered; fp8 sources
  gathered and multiplied, as jax.jit computes within the formats' error."""
  from jax.sharding import AxisType, reshard
  devices = jax.devices("cpu")[:4]
  mesh = jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Explicit,), devices=devices)

  def gathered(x, w1, w2, s):
    h = reshard(qdq(x, s[0]), P(None, None))
    a = jnp.matmul(h, qdq(w1, s[1]))
    return jnp.matmul(qdq(a, s[2]), qdq(w2, s[3]), out_sharding=P("tp", None))

  def implied(x, w1, w2, s):
    a = jnp.matmul(qdq(x, s[0]), qdq(w1, s[1]), out_sharding=P(None, "tp"))
    return jnp.matmul(qdq(a, s[2]), qdq(w2, s[3]), out_sharding=P("tp", None))

  with jax.set_mesh(mesh):
    k = jax.random.split(fresh_key(), 3)
    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
    args = (put(_bf16(k[0], (64, 128)), P("tp", None)), put(_bf16(k[1], (128, 256), 0.1),
            P(None, "tp")), put(_bf16(k[2], (256, 128), 0.1), P("tp", None)),
            jnp.array([0.01, 0.001, 0.01, 0.001], jnp.float32))
    for f in (gathered, implied):
      fused = ao.jit(f, overlap_config=ao.OverlapConfig(impl="reference"))
      rows = sorted((m.kind, m.status, m.dtype) for m in fused.explain(*args).matches)
      assert rows == [("ag_matmul", "fused", "e4m3xe4m3->bfloat16"),
                      ("matmul_rs", "fused", "e4m3xe4m3->bfloat16")], f.__name__
      assert rel_err(fused(*args), jax.jit(f)(*args)) <= fp8.quantization_error(E4, E4)
