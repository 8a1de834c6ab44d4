"""Rewrite coverage: several gathers on one matmul, sums of matmuls before a psum_scatter,
per-match fallback, a TP+SP training step, and an explain a user can act on."""
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_autooverlap as ao
from jax_autooverlap.rewrite import interpreter
from conftest import assert_close, cpu_mesh, fresh_key, randn
from test_rewrite import AG, RS, _put, check, smap

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _args(mesh, shapes_specs, dtype=np.float32):
  ks = jax.random.split(fresh_key(), len(shapes_specs))
  arrays = [randn(k, shape, dtype) / 2 for k, (shape, _) in zip(ks, shapes_specs)]
  return _put(mesh, arrays, [spec for _, spec in shapes_specs])


def _collectives(jaxpr) -> list:
  """Every all_gather / reduce_scatter equation, at any depth."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("all_gather", "reduce_scatter"):
      out.append(eqn)
    for sub in interpreter._jax.sub_jaxprs(eqn.params):
      out += _collectives(sub)
  return out


# -- several gathers feeding one matmul --------------------------------------------------------

def _fsdp_sp(remat):
  """Sequence parallel over tp (activations gathered on the sequence dim) and FSDP over dp
  (the column-parallel weight also sharded on its rows, gathered before use)."""
  mesh = cpu_mesh((2, 4), ("dp", "tp"))

  def body(x, w):  # x [b/dp, s/tp, h], w [h/dp, f/tp]
    xf = lax.all_gather(x, "tp", axis=1, tiled=True)
    wf = lax.all_gather(w, "dp", axis=0, tiled=True)
    return jnp.tanh(jnp.einsum("bsh,hf->bsf", xf, wf))

  body = jax.checkpoint(body) if remat else body
  specs = (P("dp", "tp"), P("dp", "tp"))
  f = smap(mesh, body, specs, P("dp", None, "tp"))
  return f, _args(mesh, [((4, 8, 16), specs[0]), ((16, 8), specs[1])])


@pytest.mark.parametrize("remat", [False, True])
def test_fsdp_times_sequence_parallel(remat):
  f, args = _fsdp_sp(remat)
  report = check(f, args, [("ag_matmul", "fused"), ("ag_matmul", "skipped")])
  fused, = report.fused
  skipped, = report.skipped
  assert (fused.axis_name, fused.dim_kind) == ("tp", "free")
  assert "other operand gathered over 'dp' first" in fused.note
  assert skipped.axis_name == "dp" and skipped.code == "one_per_matmul"
  assert "other operand gathered over 'dp' first" in str(report)

  # The whole training step: every collective of its jaxpr is listed, forward and backward.
  step = jax.value_and_grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1))
  report = ao.explain(step, *args)
  jaxpr = jax.make_jaxpr(step)(*args)
  assert len(report) == len(_collectives(jaxpr.jaxpr)), str(report)
  phases = {m.phase for m in report}
  assert phases == ({"fwd", "bwd", "remat"} if remat else {"fwd", "bwd"}), str(report)
  assert all(m.fused for m in report if m.kind == "matmul_rs"), str(report)
  (want_v, want_g), (got_v, got_g) = jax.jit(step)(*args), ao.jit(step)(*args)
  assert_close(got_v, want_v, np.float32)
  for g, w in zip(got_g, want_g):
    assert_close(g, w, np.float32)


@pytest.mark.parametrize("tokens,expect", [
    (32, [("ag_matmul", "skipped"), ("matmul_rs", "fused")]),   # the scatter moves more
    (4, [("ag_matmul", "fused"), ("matmul_rs", "skipped")]),    # the weight gather moves more
])
def test_gather_and_scatter_on_one_matmul(tokens, expect):
  """A row-parallel matmul with an FSDP weight gathered on a free dim: one fused op."""
  mesh = cpu_mesh((2, 4), ("dp", "tp"))
  specs = (P(None, "tp"), P("tp", "dp"))  # h [tokens, F/tp], w [F/tp, D/dp]
  args = _args(mesh, [((tokens, 32), specs[0]), ((32, 32), specs[1])])  # 8 weight rows each
  body = lambda h, w: RS(h @ AG(w, "dp", dim=1), "tp")
  report = check(smap(mesh, body, specs, P("tp", "dp")), args, expect)
  assert report.skipped[0].code == "one_per_matmul"
  assert report.skipped[0].kind == ("ag_matmul" if tokens == 32 else "matmul_rs")


def test_both_gathers_on_one_axis():
  mesh = cpu_mesh((4,), ("x",))
  specs = (P("x"), P("x"))  # rows of x (sequence) and of w (FSDP) over the same axis
  args = _args(mesh, [((8, 12), specs[0]), ((12, 6), specs[1])])
  report = check(smap(mesh, lambda x, w: AG(x) @ AG(w), specs), args,
                 [("ag_matmul", "fused"), ("ag_matmul", "skipped")])
  assert (report.fused[0].operand, report.fused[0].dim_kind) == ("lhs", "free")
  assert (report.skipped[0].operand, report.skipped[0].dim_kind) == ("rhs", "contracting")


def test_other_operand_computed_between_gather_and_matmul():
  mesh = cpu_mesh((4,), ("x",))
  specs = (P("x"), P())
  args = _args(mesh, [((8, 8), specs[0]), ((8, 5), specs[1])])

  def between(x, w):
    g = AG(x)
    w2 = jnp.tanh(w) * 2  # traced after the gather, before the matmul
    return g @ w2

  def first_used_elsewhere(x, w):
    g = AG(x)
    s = jnp.sum(jnp.sin(g))  # the gathered value's first use is not the matmul
    return g @ w + s

  for body in (between, first_used_elsewhere):
    check(smap(mesh, body, specs), args, [("ag_matmul", "fused")])


def test_gather_fused_into_its_free_dim_matmul():
  """One gather, a contracting-dim use first (a weight gradient) and a free-dim use after
  (an input gradient): the fused op takes the free-dim matmul, which the GPU kernel covers."""
  mesh = cpu_mesh((4,), ("x",))
  specs = (P("x"), P(), P())
  args = _args(mesh, [((32, 6), specs[0]), ((32, 5), specs[1]), ((6, 7), specs[2])])

  def body(dy, h, w):
    g = AG(dy)                                   # [32, 6]
    dw = jnp.einsum("sf,sd->fd", h, g)           # contracts the gathered rows
    dx = g @ w                                   # gathered rows are free
    return dx, dw

  f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("x"), P("x")))
  report = ao.explain(f, *args)
  m, = report.matches
  assert (m.status, m.dim_kind, m.n_dots) == ("fused", "free", 2), str(report)
  for got, want in zip(ao.jit(f)(*args), jax.jit(f)(*args)):
    assert_close(got, want, np.float32)


# -- psum_scatter of a sum of matmuls --------------------------------------------------------------

def test_summed_matmuls_become_one_gemm_rs():
  mesh = cpu_mesh((4,), ("x",))
  specs = (P(None, "x"),) * 6
  shapes = [(16, 8), (12, 8), (16, 4), (12, 4), (16, 12), (12, 12)]  # dq, wq, dk, wk, dv, wv
  args = _args(mesh, list(zip(shapes, specs)))

  def body(dq, wq, dk, wk, dv, wv):  # the VJP of one gather feeding Q/K/V
    return RS(dq @ wq.T + dk @ wk.T + dv @ wv.T)

  report = check(smap(mesh, body, specs), args, [("matmul_rs", "fused")])
  m = report.matches[0]
  assert m.n_dots == 3 and m.lhs_shape == (16, 6) and m.rhs_shape == (6, 12), str(report)
  assert "sum of 3 matmuls" in str(report)
  # On CPU the program lowers to the ring only: no reduce-scatter is left.
  hlo = ao.jit(smap(mesh, body, specs)).lower(*args).as_text()
  assert "reduce_scatter" not in hlo and "collective_permute" in hlo


def test_summed_matmuls_with_several_contracting_dims():
  mesh = cpu_mesh((4,), ("x",))
  specs = (P(None, "x"),) * 4
  args = _args(mesh, [((8, 4, 3), specs[0]), ((6, 4, 3), specs[1]), ((8, 4, 2), specs[2]),
                      ((6, 4, 2), specs[3])])

  def body(a, wa, b, wb):  # heads x head_dim contracted, as in an attention output projection
    return RS(jnp.einsum("snd,hnd->sh", a, wa) + jnp.einsum("snd,hnd->sh", b, wb))

  report = check(smap(mesh, body, specs), args, [("matmul_rs", "fused")])
  assert report.matches[0].n_dots == 2 and report.matches[0].lhs_shape == (8, 3 + 2)


def test_summed_matmuls_that_cannot_be_merged_are_listed():
  mesh = cpu_mesh((4,), ("x",))
  specs = (P(None, "x"), P("x"), P(None, "x"), P("x"), P())
  args = _args(mesh, [((8, 8), spec) for spec in specs])
  cases = {
      "other term": (lambda a, b, c, d, e: RS(a @ b + jnp.sin(e)), "sum_other_terms"),
      "layouts": (lambda a, b, c, d, e: RS((a @ b).T + c @ d), "sum_layouts_differ"),
      "used twice": (lambda a, b, c, d, e: (lambda y: RS(y + c @ d) + RS(y))(a @ b),
                     "result_used_elsewhere"),
  }
  for name, (body, reason) in cases.items():
    report = ao.explain(smap(mesh, body, specs), *args)
    assert any(m.kind == "matmul_rs" and m.status == "skipped" and m.code == reason
               for m in report), (name, str(report))
    assert_close(ao.jit(smap(mesh, body, specs))(*args), jax.jit(smap(mesh, body, specs))(*args),
                 np.float32)
  # operands of different dtypes cannot be concatenated
  bf = [a.astype(jnp.bfloat16) for a in args[2:4]]
  body = lambda a, b, c, d: RS(a @ b + (c @ d).astype(np.float32))
  report = ao.explain(smap(mesh, body, specs[:4]), args[0], args[1], *bf)
  assert report.matches[0].status == "skipped", str(report)


# -- a tensor + sequence parallel training step ------------------------------------------------

S, D, HEADS, HEAD_DIM, FFN = 16, 16, 8, 4, 32


def _rms(x, g):
  return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def _layer(x, p, n):
  """Llama-style block, Megatron TP + sequence parallelism: x [S/n, D]."""
  hg = AG(_rms(x, p["n1"]), "tp")                       # one sequence gather feeds Q, K, V
  q, k, v = (hg @ p[w] for w in ("wq", "wk", "wv"))      # [S, heads/n * head_dim]
  q, k, v = (t.reshape(S, HEADS // n, HEAD_DIM) for t in (q, k, v))
  s = jnp.einsum("qhd,khd->hqk", q, k) / HEAD_DIM ** 0.5
  s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -1e9)
  o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s), v).reshape(S, -1)
  x = x + RS(o @ p["wo"], "tp")
  hg = AG(_rms(x, p["n2"]), "tp")                       # one gather feeds gate and up
  return x + RS(jax.nn.silu(hg @ p["wg"]) * (hg @ p["wu"]) @ p["wd"], "tp")


def _training_step(remat):
  n = 4
  mesh = cpu_mesh((n,), ("tp",))
  col, row = P(None, "tp"), P("tp")
  pspec = dict(n1=P(), n2=P(), wq=col, wk=col, wv=col, wo=row, wg=col, wu=col, wd=row)
  shapes = dict(n1=(D,), n2=(D,), wq=(D, HEADS * HEAD_DIM), wk=(D, HEADS * HEAD_DIM),
                wv=(D, HEADS * HEAD_DIM), wo=(HEADS * HEAD_DIM, D), wg=(D, FFN), wu=(D, FFN),
                wd=(FFN, D))
  layer = jax.checkpoint(_layer, static_argnums=(2,)) if remat else _layer

  def body(x, params):
    for p in params:
      x = layer(x, p, n)
    return lax.psum(jnp.sum(x * x), "tp")

  loss = jax.shard_map(body, mesh=mesh, in_specs=(row, [pspec] * 2), out_specs=P())
  params = []
  for _ in range(2):
    names = sorted(shapes)
    vals = _args(mesh, [(shapes[k], pspec[k]) for k in names])
    params.append(dict(zip(names, vals)))
  x = _args(mesh, [((S, D), row)])[0]
  return jax.value_and_grad(loss, argnums=(0, 1)), (x, params)


@pytest.mark.parametrize("remat", [False, True])
def test_training_step_every_collective_listed(remat):
  step, args = _training_step(remat)
  report = ao.explain(step, *args)
  collectives = _collectives(jax.make_jaxpr(step)(*args).jaxpr)
  kinds = {"all_gather": "ag_matmul", "reduce_scatter": "matmul_rs"}
  assert sorted(m.kind for m in report) == sorted(kinds[e.primitive.name] for e in collectives)
  assert all(m.fused for m in report), str(report)
  # per layer: forward 2 gathers + 2 scatters; backward the duals, QKV / gate-up summed
  by_phase = {ph: sum(m.phase == ph for m in report) for ph in ("fwd", "bwd", "remat")}
  assert (by_phase["fwd"], by_phase["bwd"]) == (8, 8), str(report)
  assert (by_phase["remat"] > 0) == remat, str(report)  # what the backward recomputes
  summed = sorted(m.n_dots for m in report if m.kind == "matmul_rs" and m.phase == "bwd")
  assert summed == [2, 2, 3, 3], str(report)
  (want_v, want_g), (got_v, got_g) = jax.jit(step)(*args), ao.jit(step)(*args)
  assert_close(got_v, want_v, np.float32)
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    assert_close(g, w, np.float32, factor=5)


# -- whatever fails for one match keeps that match unfused ----------------------------------------

def test_internal_error_in_one_match_keeps_it_unfused(monkeypatch):
  from test_rewrite import mlp_body, mlp_setup
  mesh, specs, args = mlp_setup()
  f = smap(mesh, mlp_body, specs)

  def broken(*a, **k):
    raise RuntimeError("boom in matmul_rs")

  monkeypatch.setattr(interpreter, "matmul_rs", broken)
  with pytest.warns(RuntimeWarning, match="boom in matmul_rs"):
    report = ao.explain(f, *args)
  assert [(m.kind, m.status) for m in report] == [("ag_matmul", "fused"),
                                                  ("matmul_rs", "skipped")], str(report)
  assert report.matches[1].code == "internal_error" and "boom" in report.matches[1].reason
  with pytest.warns(RuntimeWarning):
    got = ao.jit(f)(*args)
  assert_close(got, jax.jit(f)(*args), np.float32)


def test_internal_error_rebuilding_keeps_the_equation(monkeypatch):
  from test_rewrite import mlp_body, mlp_setup
  mesh, specs, args = mlp_setup()
  f = smap(mesh, mlp_body, specs)

  def broken(interp, eqn, invals):
    raise ValueError("cannot rebuild")

  monkeypatch.setitem(interpreter.RULES, "shard_map", broken)
  with pytest.warns(RuntimeWarning, match="cannot rebuild"):
    report = ao.explain(f, *args)
  assert [m.status for m in report] == ["skipped", "skipped"], str(report)
  assert all(m.code == "internal_error" for m in report)
  with pytest.warns(RuntimeWarning):
    assert_close(ao.jit(f)(*args), jax.jit(f)(*args), np.float32)


# -- explain ----------------------------------------------------------------------------------------

def gather_helper(x):
  return lax.all_gather(x, "x", axis=0, tiled=True)


def test_explain_shows_pass_path_and_both_source_lines():
  from test_rewrite import mlp_setup
  mesh, specs, args = mlp_setup()

  def body(x, w1, w2):
    h = jnp.tanh(gather_helper(x) @ w1)  # MATMUL-LINE
    return RS(h @ w2)

  def inner(x, w1, w2):
    return lax.scan(lambda c, _: (c + body(c, w1, w2), None), x, None, length=2)[0]

  f = smap(mesh, inner, specs)
  loss = lambda *a: jnp.sum(f(*a) ** 2)
  report = ao.explain(jax.grad(loss, argnums=(0, 1, 2)), *args)
  assert {m.phase for m in report} == {"fwd", "bwd"}, str(report)
  ag = next(m for m in report if m.kind == "ag_matmul" and m.phase == "fwd")
  src = pathlib.Path(__file__).read_text().splitlines()
  line_of = lambda s: int(re.search(r":(\d+)", s).group(1))
  assert "MATMUL-LINE" in src[line_of(ag.dot_source) - 1]
  assert "lax.all_gather" in src[line_of(ag.source) - 1]
  assert "scan" in ag.path and "shard_map" in ag.path
  text = str(report)
  assert "pass" in text.splitlines()[0] and "bwd" in text and "VJP of the matmul" in text
  assert ag.path in text and "matmul at" in text


def test_skip_reason_names_the_failing_operand():
  mesh = cpu_mesh((4,), ("x",))
  x = randn(fresh_key(), (8, 8), jnp.bfloat16)
  w = jnp.ones((8, 4), jnp.int8)
  specs = (P("x"), P())
  f = smap(mesh, lambda x, w: AG(x) @ w, specs)
  report = ao.explain(f, *_put(mesh, [x, w], specs))
  m, = report.matches
  assert m.status == "skipped" and m.code == "dtype" and "other operand (rhs)" in m.reason, \
      str(report)


def test_impl_unfused_and_triton_without_gpu():
  from test_rewrite import mlp_body, mlp_setup
  mesh, specs, args = mlp_setup()
  f = smap(mesh, mlp_body, specs)
  want = jax.jit(f)(*args)
  unfused = ao.OverlapConfig(impl="unfused")
  report = ao.explain(f, *args, overlap_config=unfused)
  assert [m.status for m in report] == ["unfused", "unfused"], str(report)
  assert not report.fused and "0 fused" in str(report) and "2 unfused" in str(report)
  assert_close(ao.jit(f, overlap_config=unfused)(*args), want, np.float32)

  triton = ao.OverlapConfig(impl="triton")
  report = ao.explain(f, *args, overlap_config=triton)
  assert [m.status for m in report] == ["skipped", "skipped"], str(report)
  assert all(m.code == "impl_unavailable" for m in report)
  assert_close(ao.jit(f, overlap_config=triton)(*args), want, np.float32)


def test_overlap_config_type_is_checked_at_jit_time():
  f = lambda x: x
  for bad in ({"impl": "reference"}, "reference"):
    with pytest.raises(TypeError, match="overlap_config must be an ao.OverlapConfig"):
      ao.jit(f, overlap_config=bad)
    with pytest.raises(TypeError, match="overlap_config"):
      ao.jit(overlap_config=bad)
    with pytest.raises(TypeError, match="overlap_config"):
      ao.explain(f, jnp.ones(2), overlap_config=bad)
  with pytest.raises(TypeError, match=re.escape("ao.OverlapConfig(**{'impl': 'reference'})")):
    ao.jit(f, overlap_config={"impl": "reference"})


def test_untiled_gather_with_merging_reshape_is_fused():
  mesh = cpu_mesh((4,), ("x",))
  specs = (P("x"), P())
  args = _args(mesh, [((2 * 4, 3, 8), specs[0]), ((8, 5), specs[1])])

  def body(x, w):  # the pre-`tiled=` idiom: gather a new axis, then merge it
    g = lax.all_gather(x, "x", axis=0)                  # [4, 2, 3, 8]
    return g.reshape(-1, 8) @ w                         # [4*2*3, 8]

  report = check(smap(mesh, body, specs), args, [("ag_matmul", "fused")])
  assert report.matches[0].dim_kind == "free"
  # its VJP is an untiled psum_scatter after the reshape that splits the axis off: fused too
  loss = lambda x, w: jnp.sum(smap(mesh, body, specs)(x, w) ** 2)
  grad_report = ao.explain(jax.grad(loss), *args)
  assert sorted((m.kind, m.phase, m.status) for m in grad_report) == [
      ("ag_matmul", "fwd", "fused"), ("matmul_rs", "bwd", "fused")], str(grad_report)

  # an untiled scatter written by hand, after the reshape that splits its axis off
  rs_specs = (P(None, "x"), P("x"))
  rs_args = _args(mesh, [((8, 16), rs_specs[0]), ((16, 6), rs_specs[1])])
  rs_body = lambda h, w: lax.psum_scatter((h @ w).reshape(4, -1, 6), "x")  # [4, 2, 6] -> [2, 6]
  check(smap(mesh, rs_body, rs_specs), rs_args, [("matmul_rs", "fused")])

  # a new last axis interleaves the gathered blocks: no tiled equivalent
  args = _args(mesh, [((8, 3), specs[0]), ((8, 5), specs[1])])
  body_last = lambda x, w: lax.all_gather(x, "x", axis=2).reshape(-1, 8) @ w
  report = ao.explain(smap(mesh, body_last, specs), *args)
  assert report.matches[0].status == "skipped" and report.matches[0].code == "untiled"


def test_adjacent_collectives_that_cannot_fuse_are_listed():
  mesh = cpu_mesh((4,), ("x",))
  specs = (P("x"), P())
  args = _args(mesh, [((8, 8), specs[0]), ((8, 5), specs[1])])
  body = lambda x, w: (lambda g: g.T.T @ w + jnp.sum(jnp.sin(g)))(AG(x))
  report = check(smap(mesh, body, specs), args, [("ag_matmul", "skipped")])
  assert report.matches[0].code == "used_on_the_way"


# -- the newcomer's path: Quickstart, demo, bench --------------------------------------------------

def test_readme_quickstart_runs(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored afterwards
  text = (ROOT / "README.md").read_text()
  section = text.split("## Quickstart", 1)[1]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  assert "xla_force_host_platform_device_count=8" in code.split("import jax")[0]
  namespace = {}
  exec(compile(code, "README-quickstart", "exec"), namespace)
  assert np.asarray(namespace["y"]).shape == (1024, 256)
  assert "overlap" in section.split("```")[2].lower()  # the CPU caveat right after the code


@pytest.mark.parametrize("module,expect", [
    ("jax_autooverlap.demo", "cannot show overlap"),
    ("jax_autooverlap.bench", "--shapes"),
])
def test_help_prints_instead_of_running(module, expect):
  proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                        timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                                          "PYTHONPATH": str(ROOT)})
  assert proc.returncode == 0, proc.stderr
  text = " ".join(proc.stdout.split())  # argparse wraps lines to the terminal width
  assert text.startswith("usage:") and expect in text, proc.stdout
  if module.endswith("bench"):
    assert "MxKxN" in text
