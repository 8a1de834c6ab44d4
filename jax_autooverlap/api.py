"""`ao.jit` and `ao.explain`: jax.jit with the collective-matmul rewrite applied.

`jit(f)` is `jax.jit` around a function that, when jax.jit traces it, traces
`f` to a jaxpr, plans the rewrite and re-emits the program with fused ops.
The rewrite runs once per input signature, exactly when jax.jit traces, and a
later call costs what a jax.jit call costs.

Differentiation: the traced `f` is a `jax.custom_vjp` whose rules are
rewritten too.  Its forward rule is the rewrite of `jax.vjp(f)` (the primal
outputs and the residuals, as JAX's own partial evaluation and `jax.checkpoint`
policies choose them) and its backward rule the rewrite of applying that
VJP.  So wherever the ao.jit function is differentiated (`jax.grad` inside the
user's own `jax.jit`, `nnx.jit`, `lax.scan` over layers, `jax.checkpoint`
around it) its backward program is planned by the same rewrite as its
forward, e.g. the sum `psum_scatter(da @ w1.T + db @ w3.T)` that JAX's
transposes write becomes one GEMM+RS.  A custom_vjp has no forward mode:
under `jax.jvp` / `jax.jacfwd` the function runs unfused, with a warning;
applying the linear function of `jax.linearize` raises JAX's custom_vjp error.

Each program the rewrite emits runs as a named jit call (rewrite/regions.py),
which keys its report: `explain` finds them in any traced program.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import jax
import numpy as np
from jax.tree_util import Partial

from jax_autooverlap.rewrite import (Interpreter, Report, analyze, collect, forward_mode,
                                     inline_fp8_calls, make_jaxpr, regions)
from jax_autooverlap.runtime import context
from jax_autooverlap.tuning.config import OverlapConfig, as_overlap_config


def _rewrite_and_run(fn: Callable, args, config: OverlapConfig, function: str, kind: str):
  """fn(*args) (pytrees of arrays in and out) rewritten, as one named jit call (a region)."""
  name = regions.new_name(function, kind)

  def region(*args):
    leaves, treedef = jax.tree.flatten(args)
    out_tree = []

    def flat(*leaves):
      out, tree = jax.tree.flatten(fn(*jax.tree.unflatten(treedef, leaves)))
      out_tree.append(tree)
      return out

    closed = inline_fp8_calls(make_jaxpr(flat, *leaves))
    plan = analyze(closed, config)
    regions.record(name, function, plan.report)
    if plan.has_fused:
      outs = Interpreter(plan, config).eval(closed.jaxpr, closed.consts, leaves)
    else:  # nothing to fuse: the program as traced
      outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves)
    return jax.tree.unflatten(out_tree[0], outs)

  region.__name__ = region.__qualname__ = name
  return jax.jit(region)(*args)


def _zeros_like(ct):
  """A symbolic zero cotangent made concrete (float0 for integer outputs, as jax.vjp takes)."""
  aval = ct.aval
  if np.issubdtype(aval.dtype, np.inexact):
    return jax.numpy.zeros(aval.shape, aval.dtype)
  return np.zeros(aval.shape, jax.dtypes.float0)


def _pull_back(perturbed, vjp_fn, cts):
  """vjp_fn's cotangents at the perturbed inputs, None (a zero) at the others."""
  grads = iter(vjp_fn(cts))
  return tuple(next(grads) if p else None for p in perturbed)


def _differentiable(flat_fun: Callable, config: OverlapConfig, function: str):
  """flat_fun (arrays -> list of arrays) rewritten, with rewritten forward and backward rules."""

  @jax.custom_vjp
  def call(*dyn):
    return _rewrite_and_run(flat_fun, dyn, config, function, "primal")

  def fwd(*primals):  # CustomVJPPrimal: (value, perturbed) with symbolic_zeros=True
    values = [p.value for p in primals]
    perturbed = tuple(bool(p.perturbed) for p in primals)

    def forward(*values):
      def of_perturbed(*xs):
        xs = iter(xs)
        return flat_fun(*(next(xs) if p else v for v, p in zip(values, perturbed)))
      outs, vjp_fn = jax.vjp(of_perturbed, *(v for v, p in zip(values, perturbed) if p))
      return outs, Partial(functools.partial(_pull_back, perturbed), vjp_fn)

    return _rewrite_and_run(forward, values, config, function, "fwd")

  def bwd(pull_back, cts):
    cts = [_zeros_like(ct) if isinstance(ct, jax.custom_derivatives.SymbolicZero) else ct
           for ct in cts]
    floats = [i for i, ct in enumerate(cts) if ct.dtype != jax.dtypes.float0]

    def backward(pull_back, float_cts):  # float0 cotangents stay constants (never jit operands)
      full = list(cts)
      for i, ct in zip(floats, float_cts):
        full[i] = ct
      return pull_back(full)

    return _rewrite_and_run(backward, (pull_back, [cts[i] for i in floats]), config, function,
                            "bwd")

  call.defvjp(fwd, bwd, symbolic_zeros=True)
  return call


class AutoOverlapJit:
  """What `ao.jit` returns: callable like the `jax.jit` object it wraps."""

  def __init__(self, fun: Callable, overlap_config: OverlapConfig | None = None, **jit_kwargs):
    if not callable(fun):
      raise TypeError(f"ao.jit expects a callable, got {type(fun).__name__}")
    self._fun = fun
    self._config = as_overlap_config(overlap_config, "ao.jit: overlap_config")
    self._name = getattr(fun, "__name__", type(fun).__name__)
    self._jit_kwargs = jit_kwargs
    traced = lambda *args, **kwargs: self._traced(*args, **kwargs)
    self._jitted = jax.jit(functools.wraps(fun)(traced), **jit_kwargs)
    self._unfused = jax.jit(fun, **jit_kwargs)
    functools.update_wrapper(self, fun)

  def _traced(self, *args, **kwargs):
    """What jax.jit traces: `fun` as a differentiable, rewritten function of its array leaves
    (under jax.jit every dynamic argument is a tracer; other leaves are static, closed over)."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dyn_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    out_tree = []

    def flat_fun(*dyn):
      full = list(leaves)
      for i, x in zip(dyn_pos, dyn):
        full[i] = x
      a, k = jax.tree.unflatten(treedef, full)
      out, tree = jax.tree.flatten(self._fun(*a, **k))
      out_tree.append(tree)
      return out

    outs = _differentiable(flat_fun, self._config, self._name)(*(leaves[i] for i in dyn_pos))
    return jax.tree.unflatten(out_tree[0], outs)

  def __call__(self, *args, **kwargs):
    if forward_mode(jax.tree.leaves((args, kwargs))):
      # jax.jvp / jax.jacfwd: a custom_vjp has no JVP, so the function runs as written.
      warnings.warn(f"ao.jit({self._name}): forward-mode differentiation (jax.jvp, jax.jacfwd) "
                    "runs the unfused program; ao.jit fuses the primal program and, under "
                    "jax.grad / jax.vjp, the forward and backward programs", RuntimeWarning,
                    stacklevel=2)
      return self._unfused(*args, **kwargs)
    return self._jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self._jitted.lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    return self._jitted.trace(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    return self._jitted.eval_shape(*args, **kwargs)

  def explain(self, *args, **kwargs) -> Report:
    """Trace (without running or measuring) and report every candidate, fused or skipped, and
    why; shapes whose first call will measure the kernel are "pending"."""
    with context.explaining():
      return collect(self.trace(*args, **kwargs).jaxpr)

  def __get__(self, obj, objtype=None):  # usable as a method decorator, like jax.jit
    if obj is None:
      return self
    return functools.partial(self, obj)


def jit(fun: Callable | None = None, /, *, overlap_config: OverlapConfig | None = None,
        **jit_kwargs: Any):
  """Drop-in `jax.jit` that fuses collective matmuls inside shard_map bodies and in
  explicit-sharding programs, in the forward and (under differentiation) backward programs.

  Every keyword of jax.jit (in/out_shardings, static_argnums, donate_argnums,
  ...) is forwarded.  `overlap_config` sets how the fused ops run.
  """
  if fun is None:
    as_overlap_config(overlap_config, "ao.jit: overlap_config")
    return functools.partial(jit, overlap_config=overlap_config, **jit_kwargs)
  return AutoOverlapJit(fun, overlap_config, **jit_kwargs)


def _trace(fun, args, kwargs):
  """The closed jaxpr of fun called as given: a jit wrapper's own `trace` (jax.jit, nnx.jit:
  static arguments and modules handled as in a call, nothing run or mutated), else fun traced
  with its abstract arguments, or called under jax.make_jaxpr with its concrete ones."""
  if callable(getattr(fun, "trace", None)):
    traced = fun.trace(*args, **kwargs)
    traced = getattr(traced, "traced", traced)  # nnx.jit's wraps jax's
    if hasattr(traced, "jaxpr"):
      return traced.jaxpr
  if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves((args, kwargs))):
    return jax.make_jaxpr(fun)(*args, **kwargs)
  return jax.make_jaxpr(lambda: fun(*args, **kwargs))()


def explain(fun: Callable, *args, overlap_config: OverlapConfig | None = None, **kwargs) -> Report:
  """Report, for every all_gather/psum_scatter next to a matmul, fused or skipped and why.

  - `fun` an ao.jit function: what its rewrite does.
  - `fun` anything that calls ao.jit functions (a jitted training step, at any depth): what
    runs when `fun` runs: the rows of every ao.jit function's forward and, under
    differentiation, backward rewrite (marked with the function), and the collectives outside
    every ao.jit function, which run as written.
  - any other `fun`: what `ao.jit(fun)` would do (`overlap_config` sets its config).
  """
  if isinstance(fun, AutoOverlapJit):
    if overlap_config is not None and overlap_config != fun._config:
      raise ValueError(f"ao.explain: {fun._name} is an ao.jit function with its own "
                       f"overlap_config ({fun._config}); pass the config to ao.jit, not to "
                       "ao.explain")
    return fun.explain(*args, **kwargs)
  as_overlap_config(overlap_config, "ao.explain: overlap_config")
  with context.explaining():  # plans, never measures: a call's first trace does that
    report = collect(_trace(fun, args, kwargs), outside=True)
  if report.has_regions:
    return report
  return AutoOverlapJit(fun, overlap_config).explain(*args, **kwargs)
