"""ao.jit / ao.explain: the rewrite finds, fuses (or skips, with a reason) and stays exact."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_autooverlap as ao
from conftest import assert_close, cpu_mesh, fresh_key, randn

AG = lambda x, axis="x", dim=0: lax.all_gather(x, axis, axis=dim, tiled=True)
RS = lambda y, axis="x", dim=0: lax.psum_scatter(y, axis, scatter_dimension=dim, tiled=True)


def _put(mesh, arrays, specs):
  return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs)]


def check(fn, args, expect, *, dtype=np.float32, grads=True):
  """ao.jit(fn) == jax.jit(fn) in value (and gradient); explain lists `expect`."""
  report = ao.explain(fn, *args)
  got_kinds = sorted((m.kind, m.status) for m in report.matches)
  assert got_kinds == sorted(expect), str(report)
  for m in report.skipped:
    assert m.reason, m
  assert_close(ao.jit(fn)(*args), jax.jit(fn)(*args), dtype)
  if grads:
    ct = randn(fresh_key(), jax.eval_shape(fn, *args).shape, np.float32)
    loss = lambda *a: jnp.sum(fn(*a).astype(np.float32) * ct)
    argnums = tuple(range(len(args)))
    want = jax.jit(jax.grad(loss, argnums))(*args)
    # grad of a rewritten function, and the rewrite applied to the whole grad program.
    ao_loss = lambda *a: jnp.sum(ao.jit(fn)(*a).astype(np.float32) * ct)
    for got in (jax.jit(jax.grad(ao_loss, argnums))(*args), ao.jit(jax.grad(loss, argnums))(*args)):
      for g, w in zip(got, want):
        assert_close(g, w, dtype)
  return report


def mlp_body(x, w1, w2):
  h = jnp.tanh(AG(x) @ w1)
  return RS(h @ w2)


def mlp_setup(n=4, tokens=2, hidden=8, ffn=4, axis="x", mesh=None):
  mesh = mesh or cpu_mesh((n,), (axis,))
  ks = jax.random.split(fresh_key(), 3)
  arrays = [randn(ks[0], (tokens * n, hidden), np.float32),
            randn(ks[1], (hidden, ffn * n), np.float32) / 3,
            randn(ks[2], (ffn * n, hidden), np.float32) / 3]
  specs = (P(axis), P(None, axis), P(axis))
  return mesh, specs, _put(mesh, arrays, specs)


def smap(mesh, body, specs, out=P("x")):
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out)


BOTH = [("ag_matmul", "fused"), ("matmul_rs", "fused")]


def test_mlp_block():
  mesh, specs, args = mlp_setup()
  report = check(smap(mesh, mlp_body, specs), args, BOTH)
  ag = next(m for m in report.matches if m.kind == "ag_matmul")
  assert (ag.axis_name, ag.axis_size, ag.operand, ag.dim_kind) == ("x", 4, "lhs", "free")
  assert ag.lhs_shape == (8, 8) and ag.rhs_shape == (8, 4) and ag.out_shape == (8, 4)
  assert "test_rewrite.py" in ag.source and ag.impl
  text = str(report)
  assert "ag_matmul" in text and "matmul_rs" in text and "2 fused, 0 skipped" in text


@pytest.mark.parametrize("n", [1, 2, 8])
def test_world_sizes(n):
  mesh, specs, args = mlp_setup(n=n)
  check(smap(mesh, mlp_body, specs), args, BOTH)


def test_under_nested_jit():
  mesh, specs, args = mlp_setup()
  inner = jax.jit(lambda x, w: AG(x) @ w)
  body = lambda x, w1, w2: RS(jax.jit(lambda h: h @ w2)(jnp.tanh(inner(x, w1))))
  f = jax.jit(jax.jit(smap(mesh, body, specs)))
  check(f, args, [("ag_matmul", "fused")])  # the RS's dot lives in another jaxpr: no candidate


def test_under_scan_and_fori_loop():
  mesh, specs, args = mlp_setup()

  def scan_body(x, w1, w2):
    def layer(carry, _):
      return carry + mlp_body(carry, w1, w2), None
    return lax.scan(layer, x, None, length=3)[0]

  def loop_body(x, w1, w2):
    return lax.fori_loop(0, 2, lambda i, c: c + mlp_body(c, w1, w2), x)

  check(smap(mesh, scan_body, specs), args, BOTH)
  check(smap(mesh, loop_body, specs), args, BOTH, grads=False)  # fori_loop: no reverse-mode


def test_under_cond():
  mesh, specs, args = mlp_setup()
  body = lambda x, w1, w2: lax.cond(lax.psum(jnp.sum(w1), "x") > 0, mlp_body, lambda x, w1, w2: x * 2, x, w1, w2)
  check(smap(mesh, body, specs), args, BOTH)


@pytest.mark.parametrize("policy", [None, "dots_saveable", "nothing_saveable"])
def test_under_remat(policy):
  mesh, specs, args = mlp_setup()
  pol = None if policy is None else getattr(jax.checkpoint_policies, policy)
  body = jax.checkpoint(mlp_body, policy=pol)
  check(smap(mesh, body, specs), args, BOTH)


def test_under_custom_vjp_and_custom_jvp():
  mesh, specs, args = mlp_setup()

  @jax.custom_vjp
  def cv(x, w1, w2):
    return mlp_body(x, w1, w2)
  cv.defvjp(lambda x, w1, w2: (cv(x, w1, w2), (x, w1, w2)),
            lambda res, g: jax.vjp(mlp_body, *res)[1](g))

  @jax.custom_jvp
  def cj(x, w1, w2):
    return mlp_body(x, w1, w2)
  cj.defjvp(lambda p, t: jax.jvp(mlp_body, p, t))

  check(smap(mesh, cv, specs), args, BOTH)
  check(smap(mesh, cj, specs), args, BOTH)


def test_old_experimental_shard_map():
  mesh, specs, args = mlp_setup()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.shard_map import shard_map
  check(shard_map(mlp_body, mesh=mesh, in_specs=specs, out_specs=P("x")), args, BOTH)


def test_set_mesh_explicit_axes():
  mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices("cpu")[:4])
  with jax.set_mesh(mesh):
    _, specs, args = mlp_setup(mesh=mesh)
    f = jax.shard_map(mlp_body, in_specs=specs, out_specs=P("x"))  # mesh from the context
    check(f, args, BOTH)


def test_multi_axis_mesh():
  mesh = cpu_mesh((2, 4), ("dp", "x"))
  ks = jax.random.split(fresh_key(), 3)
  x = randn(ks[0], (2 * 2, 4 * 3, 8), np.float32)  # [batch over dp, tokens over x, hidden]
  w1, w2 = randn(ks[1], (8, 16), np.float32), randn(ks[2], (16, 8), np.float32)
  specs = (P("dp", "x"), P(None, "x"), P("x"))

  def body(x, w1, w2):
    h = jnp.tanh(jnp.einsum("bsh,hf->bsf", AG(x, dim=1), w1))
    return RS(jnp.einsum("bsf,fh->bsh", h, w2), dim=1)
  check(smap(mesh, body, specs, P("dp", "x")), _put(mesh, [x, w1, w2], specs), BOTH)


def test_multi_axis_collective_is_skipped():
  mesh = cpu_mesh((2, 4), ("a", "b"))
  ks = jax.random.split(fresh_key(), 2)
  x, w = randn(ks[0], (16, 8), np.float32), randn(ks[1], (8, 4), np.float32)
  specs = (P(("a", "b")), P())
  f = smap(mesh, lambda x, w: AG(x, ("a", "b")) @ w, specs, P(("a", "b")))
  report = check(f, _put(mesh, [x, w], specs), [("ag_matmul", "skipped")])
  assert report.matches[0].code == "multi_axis"


def test_qkv_one_gather_three_dots():
  mesh = cpu_mesh((4,), ("x",))
  ks = jax.random.split(fresh_key(), 4)
  x = randn(ks[0], (8, 8), np.float32)
  ws = [randn(k, (8, 4), np.float32) for k in ks[1:]]
  specs = (P("x"), P(), P(), P())

  def body(x, wq, wk, wv):
    g = AG(x)
    q, k, v = g @ wq, g @ wk, g @ wv
    return jax.nn.softmax(q @ k.T) @ v

  report = check(smap(mesh, body, specs), _put(mesh, [x, *ws], specs), [("ag_matmul", "fused")])
  assert report.matches[0].n_dots == 3
  # On CPU the program lowers to the ring only: no all_gather is left.
  hlo = ao.jit(smap(mesh, body, specs)).lower(*_put(mesh, [x, *ws], specs)).as_text()
  assert "all_gather" not in hlo and "collective_permute" in hlo


@pytest.mark.parametrize("case", ["transpose", "convert", "reshape_ok", "reshape_split"])
def test_layout_ops_between_gather_and_matmul(case):
  mesh = cpu_mesh((4,), ("x",))
  ks = jax.random.split(fresh_key(), 2)
  if case == "transpose":
    x, w = randn(ks[0], (8, 4 * 3), np.float32), randn(ks[1], (8, 5), np.float32)
    specs, body, status = (P(None, "x"), P()), lambda x, w: AG(x, dim=1).T @ w, "fused"
    dtype = np.float32
  elif case == "convert":
    x, w = randn(ks[0], (8, 8), jnp.bfloat16), randn(ks[1], (8, 5), np.float32)
    specs, body, status = (P("x"), P()), lambda x, w: AG(x).astype(np.float32) @ w, "fused"
    dtype = jnp.bfloat16  # x's gradient is bf16
  elif case == "reshape_ok":  # [S, B, H] gathered on S, merged to [S*B, H]: blocks stay contiguous
    x, w = randn(ks[0], (4 * 2, 3, 8), np.float32), randn(ks[1], (8, 5), np.float32)
    specs, body, status = (P("x"), P()), lambda x, w: AG(x).reshape(-1, 8) @ w, "fused"
    dtype = np.float32
  else:  # [B, S, H] gathered on S, merged to [B*S, H]: the gathered blocks interleave
    x, w = randn(ks[0], (3, 4 * 2, 8), np.float32), randn(ks[1], (8, 5), np.float32)
    specs, body, status = (P(None, "x"), P()), lambda x, w: AG(x, dim=1).reshape(-1, 8) @ w, \
        "skipped"
    dtype = np.float32
  report = check(smap(mesh, body, specs), _put(mesh, [x, w], specs), [("ag_matmul", status)],
                 dtype=dtype)
  if status == "skipped":
    assert report.matches[0].code == "layout_splits_dim"


@pytest.mark.parametrize("case", ["convert", "transpose"])
def test_layout_ops_between_matmul_and_scatter(case):
  mesh = cpu_mesh((4,), ("x",))
  ks = jax.random.split(fresh_key(), 2)
  x, w = randn(ks[0], (8, 16), np.float32), randn(ks[1], (16, 12), np.float32)
  specs = (P(None, "x"), P("x"))
  if case == "convert":
    body, dtype = lambda x, w: RS((x @ w).astype(jnp.bfloat16)), jnp.bfloat16
  else:
    body, dtype = lambda x, w: RS((x @ w).T), np.float32
  check(smap(mesh, body, specs), _put(mesh, [x, w], specs), [("matmul_rs", "fused")], dtype=dtype)


def test_fsdp_weight_gather():
  mesh = cpu_mesh((4,), ("x",))
  ks = jax.random.split(fresh_key(), 2)
  x, w = randn(ks[0], (4 * 2, 16), np.float32), randn(ks[1], (16, 6), np.float32)
  specs = (P("x"), P("x"))  # activations sharded by batch, weight rows sharded (FSDP)
  report = check(smap(mesh, lambda x, w: x @ AG(w), specs), _put(mesh, [x, w], specs),
                 [("ag_matmul", "fused")])
  assert (report.matches[0].operand, report.matches[0].dim_kind) == ("rhs", "contracting")


def test_negative_cases_stay_unfused():
  mesh = cpu_mesh((4,), ("x",))
  ks = jax.random.split(fresh_key(), 2)
  x, w = randn(ks[0], (8, 8), np.float32), randn(ks[1], (8, 8), np.float32)
  specs = (P("x"), P())
  cases = {
      "untiled": (lambda x, w: jnp.einsum("nij,jk->nik", lax.all_gather(x, "x", tiled=False), w)
                  .reshape(-1, 8), "untiled"),
      "other_operand_from_gathered": (
          lambda x, w: (lambda g: g @ (w * jnp.sum(jnp.sin(g))))(AG(x)),
          "operand_from_gather"),
      "both_operands": (lambda x, w: (lambda g: lax.dot_general(g, g, (((1,), (1,)), ((), ()))))(AG(x))[:, :8] @ w,
                        "both_operands"),
  }
  for name, (body, reason) in cases.items():
    report = check(smap(mesh, body, specs), _put(mesh, [x, w], specs), [("ag_matmul", "skipped")])
    assert report.matches[0].code == reason, (name, report)

  # a matmul whose result is used besides the psum_scatter
  y, v = randn(ks[0], (8, 16), np.float32), randn(ks[1], (16, 8), np.float32)
  rs_specs = (P(None, "x"), P("x"))
  body = lambda y, v: (lambda d: RS(d) + RS(jnp.sin(d)))(y @ v)
  report = check(smap(mesh, body, rs_specs), _put(mesh, [y, v], rs_specs),
                 [("matmul_rs", "skipped")])
  assert report.matches[0].code == "result_used_elsewhere"

  # gather on a batch dim of a batched matmul
  xb, wb = randn(ks[0], (8, 3, 4), np.float32), randn(ks[1], (8, 4, 5), np.float32)
  body = lambda x, w: jnp.einsum("bij,bjk->bik", AG(x), w)
  report = check(smap(mesh, body, (P("x"), P())), _put(mesh, [xb, wb], (P("x"), P())),
                 [("ag_matmul", "skipped")])
  assert report.matches[0].code == "batch_dim"

  # integer matmul
  xi, wi = jnp.ones((8, 8), jnp.int32), jnp.ones((8, 8), jnp.int32)
  body = lambda x, w: AG(x) @ w
  report = ao.explain(smap(mesh, body, specs), *_put(mesh, [xi, wi], specs))
  assert report.matches[0].status == "skipped" and report.matches[0].code == "dtype"
  np.testing.assert_array_equal(ao.jit(smap(mesh, body, specs))(*_put(mesh, [xi, wi], specs)),
                                jax.jit(smap(mesh, body, specs))(*_put(mesh, [xi, wi], specs)))


def test_program_without_collectives_is_untouched():
  f = lambda x: jnp.sin(x) @ x
  x = randn(fresh_key(), (4, 4), np.float32)
  assert len(ao.explain(f, x)) == 0
  assert "no all_gather" in str(ao.explain(f, x))
  np.testing.assert_array_equal(ao.jit(f)(x), jax.jit(f)(x))


def test_traces_once_per_signature_and_forwards_jit_kwargs():
  mesh, specs, args = mlp_setup()
  calls = []

  def fn(x, w1, w2, scale):
    calls.append(1)
    return smap(mesh, mlp_body, specs)(x, w1, w2) * scale

  f = ao.jit(fn, static_argnums=(3,), donate_argnums=(0,))
  x2 = jnp.array(args[0])
  out1 = f(jnp.array(args[0]), args[1], args[2], 2.0)
  n_after_first = len(calls)
  out2 = f(x2, args[1], args[2], 2.0)
  assert len(calls) == n_after_first, "re-traced for the same signature"
  np.testing.assert_array_equal(out1, out2)
  assert x2.is_deleted(), "donate_argnums was not forwarded"
  f(jnp.array(args[0]), args[1], args[2], 3.0)  # new static value -> new trace
  assert len(calls) > n_after_first
  assert "collective_permute" in f.lower(jnp.array(args[0]), args[1], args[2], 2.0).as_text()
  assert len(f.explain(jnp.array(args[0]), args[1], args[2], 2.0).fused) == 2


def test_decorator_forms():
  mesh, specs, args = mlp_setup()

  @ao.jit
  def f(x, w1, w2):
    return smap(mesh, mlp_body, specs)(x, w1, w2)

  @functools.partial(ao.jit, overlap_config=ao.OverlapConfig(impl="reference", chunks=2))
  def g(x, w1, w2):
    return smap(mesh, mlp_body, specs)(x, w1, w2)

  want = jax.jit(smap(mesh, mlp_body, specs))(*args)
  assert_close(f(*args), want, np.float32)
  assert_close(g(*args), want, np.float32)
  with pytest.raises(TypeError, match="callable"):
    ao.jit(3)


def test_no_collectives_at_all_says_so():
  report = ao.explain(lambda x, w: jnp.tanh(x @ w), jnp.ones((4, 8)), jnp.ones((8, 2)))
  assert not report.matches and "no collectives found" in str(report), str(report)
  assert "partitioner" not in str(report)
  assert ao.KernelConfig is __import__("jax_autooverlap").tuning.config.KernelConfig
