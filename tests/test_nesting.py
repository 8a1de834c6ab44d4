"""ao.jit where users put it: the model decorated, the training step under the user's own jit.

The nested pattern (`@ao.jit` model, `@jax.jit` step taking value_and_grad) must fuse what
the whole-step pattern (`ao.jit` around the step) fuses, forward and backward: the same count
of plain all-gathers / reduce-scatters in the lowered program (0 for these blocks), the same
fused rows in ao.explain, and the same losses, gradients and updated parameters as jax.jit.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_autooverlap as ao
from conftest import assert_close, cpu_mesh, fresh_key, randn
import test_explicit as te

AG = lambda x: lax.all_gather(x, "tp", axis=0, tiled=True)
RS = lambda x: lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True)
D, F, S, L = 16, 32, 32, 2  # model dim, ffn dim, tokens, layers


def tp_sp_layer(x, p):
  """Sequence-parallel x [S/tp, D]; Q/K/V-style shared gather, row-parallel out projection,
  SwiGLU MLP (gate/up sharing a gather, down reduce-scattered)."""
  g = AG(x)
  q, k, v = g @ p["wq"], g @ p["wk"], g @ p["wv"]
  x = x + RS((jax.nn.softmax(q * k, axis=-1) * v) @ p["wo"])
  g = AG(x)
  return x + RS((jax.nn.silu(g @ p["w1"]) * (g @ p["w3"])) @ p["w2"])


def tp_sp_model(mesh):
  col, row = P(None, None, "tp"), P(None, "tp", None)  # stacked [L, ...] weights
  specs = dict(wq=col, wk=col, wv=col, wo=row, w1=col, w3=col, w2=row)

  def body(params, x):
    x, _ = lax.scan(lambda x, p: (jax.checkpoint(tp_sp_layer)(x, p), None), x, params)
    return x

  return jax.shard_map(body, mesh=mesh, in_specs=(specs, P("tp")), out_specs=P("tp")), specs


def tp_sp_setup():
  mesh = cpu_mesh((4,), ("tp",))
  model, specs = tp_sp_model(mesh)
  shapes = dict(wq=(L, D, D), wk=(L, D, D), wv=(L, D, D), wo=(L, D, D), w1=(L, D, F),
                w3=(L, D, F), w2=(L, F, D))
  params = {k: jax.device_put(randn(fresh_key(), s, np.float32) / np.sqrt(s[1]),
                              NamedSharding(mesh, specs[k])) for k, s in shapes.items()}
  x = jax.device_put(randn(fresh_key(), (S, D), np.float32), NamedSharding(mesh, P("tp")))
  return model, params, x


def train_step(model, wrt_x=False):
  def step(params, x):
    loss = lambda p, x: jnp.mean(model(p, x) ** 2)
    value, grads = jax.value_and_grad(loss, argnums=(0, 1) if wrt_x else 0)(params, x)
    pgrads = grads[0] if wrt_x else grads
    new = jax.tree.map(lambda p, g: p - 0.1 * g, params, pgrads)
    return value, grads, new
  return step


def plain_collectives(fn, *args) -> tuple[int, int]:
  """(all-gather, reduce-scatter) ops in the compiled program (with explicit shardings XLA's
  partitioner inserts them after lowering)."""
  text = fn.lower(*args).compile().as_text()
  return (len(re.findall(r"= \S+ all-gather(?:-start)?\(", text)),
          len(re.findall(r"= \S+ reduce-scatter\(", text)))


def fused_rows(report):
  return sorted((m.phase, m.kind, m.status, m.lhs_shape, m.rhs_shape) for m in report
                if m.rewritten)


@pytest.mark.parametrize("wrt_x", [False, True], ids=["params", "params_and_x"])
def test_nested_step_fuses_what_the_whole_step_fuses(wrt_x):
  model, params, x = tp_sp_setup()
  plain = jax.jit(train_step(model, wrt_x))
  nested = jax.jit(train_step(ao.jit(model), wrt_x))
  whole = ao.jit(train_step(model, wrt_x))
  assert plain_collectives(plain, params, x) > (0, 0)
  assert plain_collectives(nested, params, x) == (0, 0)
  assert plain_collectives(whole, params, x) == (0, 0)
  want = plain(params, x)
  for got in (nested(params, x), whole(params, x)):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert_close(g, w, np.float32, factor=5)
  nested_report, whole_report = ao.explain(nested, params, x), ao.explain(whole, params, x)
  assert fused_rows(nested_report) == fused_rows(whole_report), (
      f"nested:\n{nested_report}\nwhole step:\n{whole_report}")
  assert {m.function for m in nested_report} == {"body"}, str(nested_report)
  # In the scanned, rematerialised layer: forward Q/K/V gather, O scatter, gate/up gather and
  # down scatter; the backward pass recomputes the first three and runs each one's dual.
  phases = [m.phase for m in nested_report.fused]
  assert (phases.count("fwd"), phases.count("remat"), phases.count("bwd")) == (4, 3, 4), \
      str(nested_report)


def test_explicit_sharding_nested_step():
  mesh, layer, x, layers = te.setup((4,))
  model = te.llama(layer, scan=True)
  step = lambda model: jax.value_and_grad(lambda x, l: jnp.mean(model(x, l) ** 2),
                                          argnums=(0, 1))
  with jax.set_mesh(mesh):
    plain, nested = jax.jit(step(model)), jax.jit(step(ao.jit(model)))
    whole = ao.jit(step(model))
    assert plain_collectives(plain, x, layers) > (0, 0)
    assert plain_collectives(nested, x, layers) == plain_collectives(whole, x, layers) == (0, 0)
    want = plain(x, layers)
    te.check_close(nested(x, layers), want)
    te.check_close(whole(x, layers), want)
    nested_report, whole_report = ao.explain(nested, x, layers), ao.explain(whole, x, layers)
    assert fused_rows(nested_report) == fused_rows(whole_report), (
        f"nested:\n{nested_report}\nwhole step:\n{whole_report}")
    phases = {m.phase for m in nested_report}
    assert phases == {"fwd", "bwd", "remat"}, str(nested_report)
    assert all(m.dot_source and "test_explicit.py" in m.dot_source for m in nested_report), \
        str(nested_report)


def test_outer_transformations_of_an_ao_jit_function():
  """grad / vjp, checkpoint around it, scan over calls of it: all fused, all equal jax.jit."""
  model, params, x = tp_sp_setup()
  fused = ao.jit(model)
  loss = lambda m: lambda p, x: jnp.mean(m(p, x) ** 2)
  programs = {
      "grad": lambda m: jax.grad(loss(m)),
      "vjp": lambda m: lambda p, x: jax.vjp(lambda p: m(p, x), p)[1](x),
      "checkpoint around": lambda m: jax.grad(loss(jax.checkpoint(m))),
      "scan over calls": lambda m: jax.grad(lambda p, x: jnp.mean(lax.scan(
          lambda c, _: (m(p, c), None), x, None, length=2)[0] ** 2)),
  }
  for name, make in programs.items():
    want = jax.jit(make(model))(params, x)
    got = jax.jit(make(fused))
    assert plain_collectives(got, params, x) == (0, 0), name
    for g, w in zip(jax.tree.leaves(got(params, x)), jax.tree.leaves(want)):
      assert_close(g, w, np.float32, factor=5)


def test_forward_mode_runs_unfused_with_a_warning():
  """jax.jvp of an ao.jit function equals that of the function (unfused, with a warning);
  jax.linearize's linear function raises JAX's custom_vjp error."""
  model, params, x = tp_sp_setup()
  fused = ao.jit(model)
  t = randn(fresh_key(), x.shape, np.float32)
  jvp = lambda f: jax.jvp(lambda x: f(params, x), (x,), (t,))
  with pytest.warns(RuntimeWarning, match=r"ao.jit\(body\): forward-mode .* unfused"):
    got = jvp(fused)
  for g, w in zip(got, jvp(model)):
    assert_close(g, w, np.float32)
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.linearize(lambda x: fused(params, x), x)[1](t)


def test_explain_names_the_collectives_outside_every_ao_jit_function():
  mesh = cpu_mesh((4,), ("tp",))
  w = jax.device_put(randn(fresh_key(), (D, D), np.float32), NamedSharding(mesh, P(None, "tp")))
  x = jax.device_put(randn(fresh_key(), (S, D), np.float32), NamedSharding(mesh, P("tp")))
  def gather(x, w):
    return AG(x) @ w

  def scatter(h, w):
    return RS(h @ w.T)

  gather = jax.shard_map(gather, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                         out_specs=P(None, "tp"))
  scatter = jax.shard_map(scatter, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")),
                          out_specs=P("tp"))

  @jax.jit
  def step(x, w):
    return scatter(ao.jit(gather)(x, w), w)  # the second op is outside any ao.jit function

  report = ao.explain(step, x, w)
  assert [(m.kind, m.status, m.code, m.function) for m in report] == [
      ("ag_matmul", "fused", "not_gpu", "gather"),
      ("matmul_rs", "skipped", "outside_ao_jit", "")], str(report)
  text = str(report)
  assert "outside any ao.jit function" in text and "gather" in text
  assert plain_collectives(step, x, w) == (0, 1)


def test_explain_of_a_function_without_ao_jit_says_what_ao_jit_would_do():
  model, params, x = tp_sp_setup()
  report = ao.explain(model, params, x)
  assert report.fused and all(m.function == "body" for m in report), str(report)
  with pytest.raises(ValueError, match="pass the config to ao.jit"):
    ao.explain(ao.jit(model), params, x, overlap_config=ao.OverlapConfig(impl="unfused"))


def test_flax_nnx_model_inside_an_nnx_jit_step():
  """A Flax NNX module whose sharded MLP is an ao.jit function, trained by an nnx.jit step with
  nnx.value_and_grad and an optax optimizer: nothing left to XLA's collectives, the same losses
  and parameters as the undecorated model, and explain's rows name the user's lines."""
  nnx = pytest.importorskip("flax.nnx")
  optax = pytest.importorskip("optax")
  mesh = cpu_mesh((4,), ("tp",))

  def mlp(x, w_in, w_out):
    h = jax.nn.gelu(AG(x) @ w_in)
    return RS(h @ w_out)

  sharded = jax.shard_map(mlp, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")),
                          out_specs=P("tp"))

  class MLP(nnx.Module):
    def __init__(self, apply, rngs):
      self.apply = apply
      self.w_in = nnx.Param(randn(rngs.params(), (D, F), np.float32) / 4)
      self.w_out = nnx.Param(randn(rngs.params(), (F, D), np.float32) / 4)

    def __call__(self, x):
      return self.apply(x, self.w_in[...], self.w_out[...])

  def train(apply):
    model = MLP(apply, nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x):
      loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
      opt.update(model, grads)
      return loss

    return model, opt, step

  x = jax.device_put(randn(fresh_key(), (S, D), np.float32), NamedSharding(mesh, P("tp")))
  (want_model, want_opt, want_step), (model, opt, step) = train(sharded), train(ao.jit(sharded))
  report = ao.explain(step, model, opt, x)
  assert [(m.phase, m.kind, m.status) for m in report] == [
      ("fwd", "ag_matmul", "fused"), ("fwd", "matmul_rs", "fused"), ("bwd", "ag_matmul", "fused")
  ], str(report)
  assert all("test_nesting.py" in m.source and m.function == "mlp" for m in report), str(report)
  for _ in range(3):
    np.testing.assert_allclose(step(model, opt, x), want_step(want_model, want_opt, x),
                               rtol=1e-5)
  assert_close(model.w_in[...], want_model.w_in[...], np.float32)
  assert_close(model.w_out[...], want_model.w_out[...], np.float32)


def test_the_forward_rule_keeps_what_jax_vjp_keeps():
  """The residuals the fused forward program hands to the backward one are jax.vjp's (the same
  count and bytes, jax.checkpoint's policy applied): no extra copies of gathered activations."""
  model, params, x = tp_sp_setup()
  fused = ao.jit(model)
  nbytes = lambda leaves: sum(l.size * l.dtype.itemsize for l in leaves)
  want = jax.tree.leaves(jax.vjp(model, params, x)[1])
  got = jax.tree.leaves(jax.vjp(fused, params, x)[1])
  assert len(got) >= len(want) and nbytes(got) == nbytes(want), (
      [(l.shape, l.dtype) for l in got], [(l.shape, l.dtype) for l in want])
