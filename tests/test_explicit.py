"""Programs without shard_map: collectives implied by explicit-sharding types are fused.

A 2-layer Llama-style block written with shardings only (sequence-parallel
activations, column/row-parallel weights; an FSDP variant), forward and a
value_and_grad step, on 4 and 2x4 meshes with Explicit axes: ao.jit equals
jax.jit and ao.explain lists each implied gather / reduce-scatter.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, reshard

import jax_autooverlap as ao
from conftest import assert_close, fresh_key, randn


def explicit_mesh(shape, names, axis_type=AxisType.Explicit):
  need = int(np.prod(shape))
  devices = jax.devices("cpu")
  if len(devices) < need:
    pytest.skip(f"needs {need} CPU devices")
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape), devices=devices[:need])


# --- a Llama-style block with explicit shardings -------------------------------------

B, S, D, H, DH, F = 2, 16, 32, 4, 8, 48


def rms_norm(x, g):
  return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def attention(q, k, v):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / DH ** 0.5
  s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -1e9)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def make_layer(dp, fsdp):
  """One block; activations [B@dp, S@tp, D]; with fsdp, weights are stored sharded on dp too."""
  act = P(dp, "tp", None)
  gathered = P(dp, None, None)

  def use(w, spec):  # FSDP: gather the weight's dp shards right before its matmul
    return reshard(w, spec) if fsdp else w

  def layer(x, p):
    h = reshard(rms_norm(x, p["g1"]), gathered)  # sequence gather
    q, k, v = (jnp.einsum("bsd,dhk->bshk", h, use(p[w], P(None, "tp", None)))
               for w in ("wq", "wk", "wv"))
    o = attention(q, k, v)
    x = x + jnp.einsum("bshk,hkd->bsd", o, use(p["wo"], P("tp", None, None)), out_sharding=act)
    h = reshard(rms_norm(x, p["g2"]), gathered)
    a = jax.nn.silu(h @ use(p["w1"], P(None, "tp"))) * (h @ use(p["w3"], P(None, "tp")))
    return x + jnp.matmul(a, use(p["w2"], P("tp", None)), out_sharding=act)

  return layer


def make_params(mesh, dp, fsdp, n_layers=2):
  f = dp if fsdp else None  # FSDP shards D (contracting for wq/wk/wv/w1/w3) over dp
  specs = dict(g1=P(None), g2=P(None), wq=P(f, "tp", None), wk=P(f, "tp", None),
               wv=P(f, "tp", None), wo=P("tp", None, f), w1=P(f, "tp"), w3=P(f, "tp"),
               w2=P("tp", f))
  shapes = dict(g1=(D,), g2=(D,), wq=(D, H, DH), wk=(D, H, DH), wv=(D, H, DH), wo=(H, DH, D),
                w1=(D, F), w3=(D, F), w2=(F, D))
  layers = []
  for _ in range(n_layers):
    p = {}
    for name, shape in shapes.items():
      w = randn(fresh_key(), shape, np.float32) / np.sqrt(shape[0])
      p[name] = jax.device_put(w + 1.0 if name[0] == "g" else w, NamedSharding(mesh, specs[name]))
    layers.append(p)
  return layers


def llama(layer, scan=False):
  if not scan:
    def model(x, layers):
      for p in layers:
        x = layer(x, p)
      return x
    return model

  def model(x, layers):  # stacked layers under lax.scan, each rematerialised
    stacked = jax.tree.map(lambda *w: jnp.stack(w), *layers)
    x, _ = lax.scan(lambda x, p: (jax.checkpoint(layer)(x, p), None), x, stacked)
    return x
  return model


def setup(shape, fsdp=False):
  names = ("dp", "tp") if len(shape) == 2 else ("tp",)
  dp = "dp" if len(shape) == 2 else None
  mesh = explicit_mesh(shape, names)
  x = jax.device_put(randn(fresh_key(), (B, S, D), np.float32),
                     NamedSharding(mesh, P(dp, "tp", None)))
  return mesh, make_layer(dp, fsdp), x, make_params(mesh, dp, fsdp)


def check_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.sharding.spec == w.sharding.spec, (g.sharding, w.sharding)
    assert_close(g, w, np.float32, factor=5)


def kinds(report):
  return sorted((m.kind, m.status) for m in report.matches)


def step_fn(model):
  loss = lambda x, layers: jnp.mean(model(x, layers) ** 2)
  return jax.value_and_grad(loss, argnums=(0, 1))


# Per layer, forward: Q/K/V gather, O reduce-scatter, gate/up gather, down reduce-scatter.
# Backward: each gather's transpose is a reduce-scatter of summed matmuls (dq wq^T + dk wk^T
# + dv wv^T), each reduce-scatter's transpose a gather feeding two matmuls (dx and dw).
FWD = [("ag_matmul", "fused")] * 2 + [("matmul_rs", "fused")] * 2
STEP = FWD * 2


@pytest.mark.parametrize("shape", [(4,), (2, 4)], ids=["tp4", "dp2xtp4"])
def test_llama_forward_and_step(shape):
  mesh, layer, x, layers = setup(shape)
  model = llama(layer)
  with jax.set_mesh(mesh):
    report = ao.explain(model, x, layers)
    assert kinds(report) == sorted(FWD * 2), str(report)
    assert all(m.origin == "explicit" and m.axis_name == "tp" and m.axis_size == 4
               for m in report), str(report)
    qkv = report.matches[0]
    assert (qkv.kind, qkv.n_dots, qkv.operand, qkv.dim_kind) == ("ag_matmul", 3, "lhs", "free")
    assert "test_explicit.py" in qkv.source and qkv.impl
    text = str(report)
    assert "[explicit]" in text and "8 fused, 0 skipped" in text
    check_close(ao.jit(model)(x, layers), jax.jit(model)(x, layers))

    step = step_fn(model)
    report = ao.explain(step, x, layers)
    assert kinds(report) == sorted(STEP * 2), str(report)
    summed = [m for m in report.matches if m.kind == "matmul_rs" and "summed" in (m.impl or "")]
    assert sorted(int(m.impl.split("; ")[1].split()[0]) for m in summed) == [2, 2, 3, 3]
    check_close(ao.jit(step)(x, layers), jax.jit(step)(x, layers))


def test_llama_scan_remat_step():
  """Layers under lax.scan and jax.checkpoint: matched inside the scan body, same numerics."""
  mesh, layer, x, layers = setup((2, 4))
  model = llama(layer, scan=True)
  step = step_fn(model)
  with jax.set_mesh(mesh):
    report = ao.explain(step, x, layers)
    # the forward in the scan, the backward (rematerialised forward + transposes) in its transpose
    assert ("ag_matmul", "fused") in kinds(report) and ("matmul_rs", "fused") in kinds(report)
    assert not report.skipped, str(report)
    assert all("scan" in m.path for m in report), [m.path for m in report]
    check_close(ao.jit(step)(x, layers), jax.jit(step)(x, layers))


def test_llama_fsdp_step():
  """FSDP x TP: weights stored sharded on dp, resharded before use (one gather fused per matmul)."""
  mesh, layer, x, layers = setup((2, 4), fsdp=True)
  model = llama(layer)
  with jax.set_mesh(mesh):
    report = ao.explain(model, x, layers)
    fused = [m for m in report.fused]
    assert {m.axis_name for m in fused if m.kind == "ag_matmul"} == {"dp", "tp"}, str(report)
    # weights sharded on their contracting dim (wq/wk/wv/w1/w3) are gathered into the matmul
    assert any(m.axis_name == "dp" and m.dim_kind == "contracting" for m in fused), str(report)
    for m in report.skipped:  # the other gather of a matmul with two, or wo/w2 beside the RS
      assert m.code in ("one_per_matmul", "communicates_besides"), m
    check_close(ao.jit(model)(x, layers), jax.jit(model)(x, layers))
    step = step_fn(model)
    report = ao.explain(step, x, layers)
    # weight gradients reduce-scattered over dp (the transpose of the FSDP gather)
    assert any(m.kind == "matmul_rs" and m.axis_name == "dp" and m.fused for m in report), \
        str(report)
    check_close(ao.jit(step)(x, layers), jax.jit(step)(x, layers))


# --- single patterns ---------------------------------------------------------------

def test_gather_with_replicated_weight_and_batch_dims():
  """A gathered activation times a replicated weight: the result replicated over the axis."""
  mesh = explicit_mesh((4,), ("tp",))
  with jax.set_mesh(mesh):
    x = jax.device_put(randn(fresh_key(), (16, 2, 8), np.float32), P("tp", None, None))
    w = jax.device_put(randn(fresh_key(), (8, 6), np.float32), P())
    f = lambda x, w: jnp.tanh(reshard(x, P()).reshape(32, 8) @ w)
    report = ao.explain(f, x, w)
    assert kinds(report) == [("ag_matmul", "fused")], str(report)
    check_close(ao.jit(f)(x, w), jax.jit(f)(x, w))
    g = jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1))
    check_close(ao.jit(g)(x, w), jax.jit(g)(x, w))


def test_casts_reshapes_and_all_reduce_then_reshard():
  """Layout ops on both sides: gather -> cast -> matmul; matmul (all-reduced) -> reshape ->
  reshard.  Without jax.set_mesh (the shardings name the mesh); grad of an ao.jit function."""
  mesh = explicit_mesh((4,), ("tp",))
  named = lambda *spec: NamedSharding(mesh, P(*spec))
  x = jax.device_put(randn(fresh_key(), (32, 16), np.float32), named("tp", None))
  w1 = jax.device_put(randn(fresh_key(), (16, 24), jnp.bfloat16), named(None, "tp"))
  w2 = jax.device_put(randn(fresh_key(), (24, 16), jnp.bfloat16), named("tp", None))

  def f(x, w1, w2):
    h = jax.nn.relu(reshard(x, named(None, None)).astype(jnp.bfloat16) @ w1)
    y = jnp.matmul(h, w2, out_sharding=named(None, None))  # partial sums all-reduced ...
    return reshard(y.reshape(4, 8, 16), named("tp", None, None))  # ... then scattered

  report = ao.explain(f, x, w1, w2)
  assert kinds(report) == [("ag_matmul", "fused"), ("matmul_rs", "fused")], str(report)
  rs = report.matches[1]
  assert (rs.collective_dim, rs.operand, rs.dim_kind, rs.out_shape) == (0, "lhs", "free", (32, 16))
  got, want = ao.jit(f)(x, w1, w2), jax.jit(f)(x, w1, w2)
  assert got.sharding.spec == want.sharding.spec
  assert_close(got, want, jnp.bfloat16)
  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(np.float32) ** 2)
  want = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(x, w1, w2)
  for got in (ao.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(x, w1, w2),
              jax.jit(jax.grad(loss(ao.jit(f)), argnums=(0, 1, 2)))(x, w1, w2)):
    for g, w in zip(got, want):
      assert g.sharding.spec == w.sharding.spec
      assert_close(g, w, jnp.bfloat16)


def test_skip_reasons():
  mesh = explicit_mesh((4,), ("tp",))
  with jax.set_mesh(mesh):
    x = jax.device_put(randn(fresh_key(), (4, 8, 8), np.float32), P("tp", None, None))
    w = jax.device_put(randn(fresh_key(), (4, 8, 8), np.float32), P())
    # gathered dim is a batch dim of the matmul
    f = lambda x, w: lax.dot_general(reshard(x, P()), w, (((2,), (1,)), ((0,), (0,))))
    report = ao.explain(f, x, w)
    assert [(m.status, m.code) for m in report] == [("skipped", "batch_dim")], str(report)
    assert_close(ao.jit(f)(x, w), jax.jit(f)(x, w), np.float32)
    # the gathered value used before the matmul
    def g(x, w):
      xg = reshard(x, P()).reshape(32, 8)
      return jnp.sum(xg ** 2) + jnp.sum(xg @ w[0])
    report = ao.explain(g, x, w)
    assert [(m.status, m.code) for m in report] == [("skipped", "used_before")], str(report)
    assert_close(ao.jit(g)(x, w), jax.jit(g)(x, w), np.float32)
    # integer matmul
    xi = jax.device_put(jnp.ones((32, 8), jnp.int32), P("tp", None))
    wi = jax.device_put(jnp.ones((8, 8), jnp.int32), P(None, "tp"))
    h = lambda x, w: reshard(x, P()) @ w
    report = ao.explain(h, xi, wi)
    assert len(report.skipped) == 1 and report.skipped[0].code == "dtype"
    np.testing.assert_array_equal(ao.jit(h)(xi, wi), jax.jit(h)(xi, wi))


# --- nothing found: say what was looked at and what to do -----------------------------

def test_auto_mesh_diagnosis():
  mesh = explicit_mesh((4,), ("tp",), AxisType.Auto)
  x = jax.device_put(jnp.ones((32, 8)), NamedSharding(mesh, P("tp", None)))
  w = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, "tp")))
  f = lambda x, w: jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("tp", None)))
  report = ao.explain(f, x, w)
  assert not report.matches
  text = str(report)
  assert "looked at 1 dot_general(s) outside shard_map (mesh axes: tp=4 Auto)" in text, text
  assert ("no shard_map or explicit-sharding collective found next to a matmul" in text
          and "inserted by XLA's partitioner" in text
          and "axis_types=Explicit" in text), text
  np.testing.assert_array_equal(ao.jit(f)(x, w), jax.jit(f)(x, w))


def test_explicit_mesh_without_collectives_diagnosis():
  mesh = explicit_mesh((4,), ("tp",))
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones((32, 8)), P())
    w = jax.device_put(jnp.ones((8, 16)), P(None, "tp"))
    text = str(ao.explain(lambda x, w: x @ w, x, w))
  assert "tp=4 Explicit" in text and "imply no all-gather or reduce-scatter" in text, text


@pytest.mark.parametrize("failing", ["AgFusion", "RsFusion"])
def test_internal_error_in_one_explicit_match_keeps_it_unfused(monkeypatch, failing):
  """A failure while emitting one fused op of an explicit-sharding program leaves that match
  as written (skipped, with the error) and the rest rewritten; the program equals jax.jit's."""
  from jax_autooverlap.rewrite.explicit import actions
  mesh, layer, x, layers = setup((4,))
  model = llama(layer)
  cls = getattr(actions, failing)
  emit, rewrites = cls.emit, []

  def first_fails(self, interp, read, env):
    # the first such op each rewrite emits fails (every trace alike: the call's, and explain's,
    # which traces anew)
    if not any(i is interp for i in rewrites):
      rewrites.append(interp)
      raise RuntimeError(f"boom in {failing}")
    return emit(self, interp, read, env)

  monkeypatch.setattr(cls, "emit", first_fails)
  with jax.set_mesh(mesh):
    want = jax.jit(model)(x, layers)
    with pytest.warns(RuntimeWarning, match=f"boom in {failing}"):
      fused = ao.jit(model)
      got = fused(x, layers)
      report = fused.explain(x, layers)
  check_close(got, want)
  assert [m.code for m in report.skipped] == ["internal_error"], str(report)
  assert len(report.fused) == len(FWD * 2) - 1, str(report)
