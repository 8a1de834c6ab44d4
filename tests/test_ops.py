"""ao.ag_matmul / ao.matmul_rs inside shard_map vs. the unfused JAX programs, values and grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_autooverlap as ao
from conftest import assert_close, cpu_mesh, fresh_key, randn

IMPLS = ["reference", "unfused", "auto"]


def _run(mesh, body, in_specs, out_spec, *arrays):
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, in_specs)]
  return f(*args)


def _grads(mesh, body, in_specs, out_spec, *arrays):
  f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, in_specs)]
  ct = randn(jax.random.key(7), jax.eval_shape(f, *args).shape, np.float32)
  loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct)
  return jax.jit(jax.grad(loss, argnums=tuple(range(len(arrays)))))(*args)


MESHES = [((2,), ("x",), "x"), ((4,), ("x",), "x"), ((8,), ("x",), "x"),
          ((2, 4), ("a", "x"), "x"), ((2, 4), ("x", "b"), "x"), ((1,), ("x",), "x")]


# --- all_gather rows -> matmul --------------------------------------------------------

@pytest.mark.parametrize("mesh_shape,names,axis", MESHES)
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_ag_rows_meshes_and_odd_rows(mesh_shape, names, axis, rows):
  mesh = cpu_mesh(mesh_shape, names)
  n = mesh.shape[axis]
  k1, k2 = jax.random.split(fresh_key())
  x = randn(k1, (rows * n, 12), np.float32)
  w = randn(k2, (12, 7), np.float32)
  spec = (P(axis), P())
  want = _run(mesh, lambda x, w: lax.all_gather(x, axis, axis=0, tiled=True) @ w, spec, P(axis), x, w)
  for impl in IMPLS:
    cfg = ao.OverlapConfig(impl=impl, chunks=2)
    got = _run(mesh, lambda x, w: ao.ag_matmul(x, w, axis, config=cfg), spec, P(axis), x, w)
    assert_close(got, want, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_ag_rows_dtypes_and_chunks(dtype, chunks):
  mesh = cpu_mesh((4,), ("x",))
  k1, k2 = jax.random.split(fresh_key())
  x, w = randn(k1, (4 * 6, 32), dtype), randn(k2, (32, 16), dtype)
  spec = (P("x"), P())
  want = _run(mesh, lambda x, w: lax.all_gather(x, "x", axis=0, tiled=True) @ w, spec, P("x"), x, w)
  cfg = ao.OverlapConfig(impl="reference", chunks=chunks)
  got = _run(mesh, lambda x, w: ao.ag_matmul(x, w, "x", config=cfg), spec, P("x"), x, w)
  assert got.dtype == want.dtype
  assert_close(got, want, dtype)


# Gathers on every operand and dim of a 3-D activation [B, S, H] and 2-D weights.
AG_CASES = [
    # name, x shape (per-device), w shape, gather_operand, gather_dim, dimension_numbers
    ("seq_parallel_3d", (2, 3, 8), (8, 5), 0, 1, None),          # Megatron SP: gather S of [B,S,H]
    ("batch_dim0_3d", (3, 4, 8), (8, 5), 0, 0, None),             # gather B of [B,S,H]
    ("rhs_columns", (6, 8), (8, 3), 1, 1, None),                  # gather columns of w
    ("fsdp_weight_rows", (6, 16), (4, 5), 1, 0, None),            # x @ AG(W_shard) on K
    ("lhs_contracting", (6, 4), (16, 5), 0, 1, None),             # AG(x on K) @ W
    ("transposed_dn", (8, 6), (5, 8), 0, 1, (((0,), (1,)), ((), ()))),  # x^T w^T via dn
    ("batched_dn", (2, 3, 8), (2, 8, 5), 0, 1, (((2,), (1,)), ((0,), (0,)))),
    ("fsdp_3d_act", (2, 3, 16), (4, 5), 1, 0, None),
]


def _unfused_ag(axis, gop, gdim, dn):
  def body(x, w):
    ops = [x, w]
    ops[gop] = lax.all_gather(ops[gop], axis, axis=gdim, tiled=True)
    dims = dn or (((ops[0].ndim - 1,), (0,)), ((), ()))
    return lax.dot_general(ops[0], ops[1], dims)
  return body


@pytest.mark.parametrize("name,xs,ws,gop,gdim,dn", AG_CASES, ids=[c[0] for c in AG_CASES])
@pytest.mark.parametrize("impl", IMPLS)
def test_ag_operands_and_dims(name, xs, ws, gop, gdim, dn, impl):
  mesh = cpu_mesh((4,), ("x",))
  n = 4
  shapes = [list(xs), list(ws)]
  shapes[gop][gdim] *= n  # global array is n shards along the gathered dim
  k1, k2 = jax.random.split(fresh_key())
  x, w = randn(k1, shapes[0], np.float32), randn(k2, shapes[1], np.float32)
  specs = [P(), P()]
  specs[gop] = P(*([None] * gdim + ["x"]))
  specs = tuple(specs)
  want = _run(mesh, _unfused_ag("x", gop, gdim, dn), specs, P("x"), x, w)
  cfg = ao.OverlapConfig(impl=impl, chunks=2)
  fused = lambda x, w: ao.ag_matmul(x, w, "x", gather_operand=gop, gather_dim=gdim,
                                    dimension_numbers=dn, config=cfg)
  got = _run(mesh, fused, specs, P("x"), x, w)
  assert_close(got, want, np.float32)
  gw = _grads(mesh, _unfused_ag("x", gop, gdim, dn), specs, P("x"), x, w)
  gg = _grads(mesh, fused, specs, P("x"), x, w)
  for a, b in zip(gg, gw):
    assert_close(a, b, np.float32)


@pytest.mark.parametrize("gop,gdim", [(0, 0), (1, 0)])
def test_ag_return_gathered(gop, gdim):
  mesh = cpu_mesh((4,), ("x",))
  k1, k2 = jax.random.split(fresh_key())
  x, w = randn(k1, (8, 8), np.float32), randn(k2, (8, 8), np.float32)
  specs = (P("x"), P()) if gop == 0 else (P(), P("x"))

  def unfused(x, w):
    ops = [x, w]
    g = lax.all_gather(ops[gop], "x", axis=gdim, tiled=True)
    ops[gop] = g
    return ops[0] @ ops[1] + jnp.sin(g).sum()

  def fused(x, w):
    out, g = ao.ag_matmul(x, w, "x", gather_operand=gop, gather_dim=gdim, return_gathered=True,
                          config=ao.OverlapConfig(impl="reference"))
    return out + jnp.sin(g).sum()

  assert_close(_run(mesh, fused, specs, P("x"), x, w), _run(mesh, unfused, specs, P("x"), x, w),
               np.float32)
  for a, b in zip(_grads(mesh, fused, specs, P("x"), x, w),
                  _grads(mesh, unfused, specs, P("x"), x, w)):
    assert_close(a, b, np.float32)


# --- matmul -> psum_scatter -------------------------------------------------------------

@pytest.mark.parametrize("mesh_shape,names,axis", MESHES)
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_rs_rows_meshes_and_odd_rows(mesh_shape, names, axis, rows):
  mesh = cpu_mesh(mesh_shape, names)
  n = mesh.shape[axis]
  k1, k2 = jax.random.split(fresh_key())
  x = randn(k1, (rows * n, 4 * n), np.float32)  # K sharded
  w = randn(k2, (4 * n, 6), np.float32)
  spec = (P(None, axis), P(axis))
  want = _run(mesh, lambda x, w: lax.psum_scatter(x @ w, axis, scatter_dimension=0, tiled=True),
              spec, P(axis), x, w)
  for impl in IMPLS:
    cfg = ao.OverlapConfig(impl=impl, chunks=2)
    got = _run(mesh, lambda x, w: ao.matmul_rs(x, w, axis, config=cfg), spec, P(axis), x, w)
    assert_close(got, want, np.float32)


RS_CASES = [
    # name, x (per device), w (per device), scatter_dim, dn
    ("rows", (8, 4), (4, 6), 0, None),
    ("columns", (6, 4), (4, 8), 1, None),
    ("seq_3d", (2, 8, 4), (4, 6), 1, None),
    ("batch_free_3d", (4, 3, 4), (4, 6), 0, None),
    ("hidden_3d", (2, 3, 4), (4, 8), 2, None),
    ("batched_dn", (2, 8, 4), (2, 4, 6), 1, (((2,), (1,)), ((0,), (0,)))),
]


@pytest.mark.parametrize("name,xs,ws,sdim,dn", RS_CASES, ids=[c[0] for c in RS_CASES])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_rs_dims_dtypes_and_grads(name, xs, ws, sdim, dn, dtype):
  mesh = cpu_mesh((4,), ("x",))
  k1, k2 = jax.random.split(fresh_key())
  x, w = randn(k1, xs, dtype), randn(k2, ws, dtype)
  specs = (P(), P())  # every device holds its own partial operands (replicated values here)
  dims = dn or (((len(xs) - 1,), (0,)), ((), ()))
  unfused = lambda x, w: lax.psum_scatter(lax.dot_general(x, w, dims), "x",
                                          scatter_dimension=sdim, tiled=True)
  cfg = ao.OverlapConfig(impl="reference", chunks=3)
  fused = lambda x, w: ao.matmul_rs(x, w, "x", scatter_dim=sdim, dimension_numbers=dn, config=cfg)
  out_spec = P(*([None] * sdim + ["x"]))
  want = _run(mesh, unfused, specs, out_spec, x, w)
  got = _run(mesh, fused, specs, out_spec, x, w)
  assert got.dtype == want.dtype
  assert_close(got, want, dtype)
  if dtype == np.float32:
    for a, b in zip(_grads(mesh, fused, specs, out_spec, x, w),
                    _grads(mesh, unfused, specs, out_spec, x, w)):
      assert_close(a, b, np.float32)


def test_preferred_element_type_and_precision():
  mesh = cpu_mesh((2,), ("x",))
  k1, k2 = jax.random.split(fresh_key())
  x, w = randn(k1, (8, 16), jnp.bfloat16), randn(k2, (16, 8), jnp.bfloat16)
  specs = (P("x"), P())
  pet = np.float32
  unfused = lambda x, w: lax.dot(lax.all_gather(x, "x", axis=0, tiled=True), w,
                                 precision=lax.Precision.HIGHEST, preferred_element_type=pet)
  fused = lambda x, w: ao.ag_matmul(x, w, "x", precision=lax.Precision.HIGHEST,
                                    preferred_element_type=pet,
                                    config=ao.OverlapConfig(impl="reference"))
  got, want = _run(mesh, fused, specs, P("x"), x, w), _run(mesh, unfused, specs, P("x"), x, w)
  assert got.dtype == want.dtype == np.float32
  assert_close(got, want, np.float32)


def test_second_order_grad_through_duals():
  mesh = cpu_mesh((2,), ("x",))
  k1, k2 = jax.random.split(fresh_key())
  x, w = randn(k1, (4, 6), np.float32), randn(k2, (6, 6), np.float32)
  specs = (P("x"), P())

  def make(mm):
    f = jax.shard_map(mm, mesh=mesh, in_specs=specs, out_specs=P("x"))
    g = lambda x, w: jax.grad(lambda x: jnp.sum(jnp.tanh(f(x, w))))(x)
    return jax.jit(lambda x, w: jax.grad(lambda w: jnp.sum(g(x, w) ** 2))(w))

  unfused = make(lambda x, w: lax.all_gather(x, "x", axis=0, tiled=True) @ w)
  fused = make(lambda x, w: ao.ag_matmul(x, w, "x", config=ao.OverlapConfig(impl="reference")))
  xs = jax.device_put(x, NamedSharding(mesh, P("x")))
  assert_close(fused(xs, w), unfused(xs, w), np.float32, factor=10)


# --- errors --------------------------------------------------------------------------------

def _trace(mesh, body, specs, *arrays):
  f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x"))
  return jax.jit(f).trace(*arrays)


def test_error_mismatched_contracting_sizes():
  mesh = cpu_mesh((4,), ("x",))
  x, w = jnp.ones((8, 16)), jnp.ones((12, 4))
  with pytest.raises(TypeError, match=r"ag_matmul: .*float32\[2,16\].*float32\[8,16\].*float32\[12,4\]"):
    _trace(mesh, lambda x, w: ao.ag_matmul(x, w, "x"), (P("x"), P()), x, w)


def test_error_non_divisible_scatter():
  mesh = cpu_mesh((4,), ("x",))
  x, w = jnp.ones((6, 8)), jnp.ones((8, 4))
  with pytest.raises(ValueError, match=r"scatter_dim=0 .*float32\[6,4\].*size 6.*size 4 of axis 'x'"):
    _trace(mesh, lambda x, w: ao.matmul_rs(x, w, "x"), (P(), P()), x, w)


def test_error_wrong_axis_name():
  mesh = cpu_mesh((4,), ("x",))
  x, w = jnp.ones((8, 8)), jnp.ones((8, 4))
  with pytest.raises(NameError, match=r"ag_matmul: unbound axis name 'y'"):
    _trace(mesh, lambda x, w: ao.ag_matmul(x, w, "y"), (P("x"), P()), x, w)
  with pytest.raises(NameError, match=r"matmul_rs: unbound axis name 'y'"):
    _trace(mesh, lambda x, w: ao.matmul_rs(x, w, "y"), (P(), P()), x, w)


def test_error_bad_dims_and_axes():
  mesh = cpu_mesh((2, 4), ("a", "x"))
  x, w = jnp.ones((8, 8)), jnp.ones((8, 4))
  specs = (P("x"), P())
  with pytest.raises(ValueError, match=r"gather_dim=5 is out of range for an operand of rank 2"):
    _trace(mesh, lambda x, w: ao.ag_matmul(x, w, "x", gather_dim=5), specs, x, w)
  with pytest.raises(ValueError, match=r"names 2 mesh axes"):
    _trace(mesh, lambda x, w: ao.ag_matmul(x, w, ("a", "x")), specs, x, w)
  with pytest.raises(ValueError, match=r"gather_operand=2"):
    _trace(mesh, lambda x, w: ao.ag_matmul(x, w, "x", gather_operand=2), specs, x, w)
  xb, wb = jnp.ones((2, 8, 8)), jnp.ones((2, 8, 4))
  dn = (((2,), (1,)), ((0,), (0,)))
  with pytest.raises(ValueError, match=r"batch dimension"):
    _trace(mesh, lambda x, w: ao.ag_matmul(x, w, "x", gather_dim=0, dimension_numbers=dn),
           (P(), P()), xb, wb)
  with pytest.raises(ValueError, match=r"scatter_dim=0 is a batch dimension"):
    _trace(mesh, lambda x, w: ao.matmul_rs(x, w, "x", scatter_dim=0, dimension_numbers=dn),
           (P(), P()), jnp.ones((4, 8, 8)), jnp.ones((4, 8, 4)))


def test_config_validation():
  with pytest.raises(ValueError, match="impl='fast'"):
    ao.OverlapConfig(impl="fast")
  with pytest.raises(ValueError, match="chunks=0"):
    ao.OverlapConfig(chunks=0)
  with pytest.raises(TypeError):
    ao.OverlapConfig("reference")  # keyword-only
  cfg = ao.OverlapConfig(impl="reference", chunks=4)
  with pytest.raises(Exception):
    cfg.chunks = 2  # frozen
