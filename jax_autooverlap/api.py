"""`ao.jit` and `ao.explain`: jax.jit with the collective-matmul rewrite applied.

`jit(f)` wraps `jax.jit` around a function that, at trace time, traces `f`
to a jaxpr, plans the rewrite and re-emits the program with fused ops.  The
rewrite therefore runs once per input signature, exactly when jax.jit traces,
and a later call costs what a jax.jit call costs.  Like a jax.jit function,
an ao.jit function may be called anywhere: at top level, inside another
jax.jit or ao.jit, in loop bodies, under grad or checkpoint.  The GPU kernels
allocate nothing per launch, so XLA may capture them into CUDA graphs
(_compat.py, "global scratch as an operand").
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from jax_autooverlap.rewrite import Interpreter, Report, analyze
from jax_autooverlap.tuning.config import OverlapConfig, as_overlap_config


def _rewriting(fun: Callable, config: OverlapConfig, sink: list | None = None) -> Callable:
  @functools.wraps(fun)
  def rewritten(*args, **kwargs):
    return _rewrite_and_run(fun, config, sink, args, kwargs)

  return rewritten


def _rewrite_and_run(fun, config, sink, args, kwargs):
  leaves, treedef = jax.tree.flatten((args, kwargs))
  # Under jax.jit every dynamic argument is a tracer (a jax.Array); other
  # leaves are static arguments and are closed over.
  dyn_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
  out_tree = []

  def flat_fun(*dyn):
    full = list(leaves)
    for i, x in zip(dyn_pos, dyn):
      full[i] = x
    a, k = jax.tree.unflatten(treedef, full)
    out_leaves, tree = jax.tree.flatten(fun(*a, **k))
    out_tree.append(tree)
    return out_leaves

  dyn = [leaves[i] for i in dyn_pos]
  closed = jax.make_jaxpr(flat_fun)(*dyn)
  plan = analyze(closed, config)
  if sink is not None:
    sink.append(plan.report)
  if not plan.has_fused:
    return fun(*args, **kwargs)  # nothing to fuse: the program is left untouched
  outs = Interpreter(plan, config).eval(closed.jaxpr, closed.consts, dyn)
  return jax.tree.unflatten(out_tree[0], outs)


class AutoOverlapJit:
  """What `ao.jit` returns: callable like the `jax.jit` object it wraps."""

  def __init__(self, fun: Callable, overlap_config: OverlapConfig | None = None, **jit_kwargs):
    if not callable(fun):
      raise TypeError(f"ao.jit expects a callable, got {type(fun).__name__}")
    self._fun = fun
    self._config = as_overlap_config(overlap_config, "ao.jit: overlap_config")
    self._jit_kwargs = jit_kwargs
    self._jitted = jax.jit(_rewriting(fun, self._config), **jit_kwargs)
    functools.update_wrapper(self, fun)

  def __call__(self, *args, **kwargs):
    return self._jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self._jitted.lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    return self._jitted.trace(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    return self._jitted.eval_shape(*args, **kwargs)

  def explain(self, *args, **kwargs) -> Report:
    """Trace (without running) and report every candidate, fused or skipped."""
    sink: list[Report] = []
    jax.jit(_rewriting(self._fun, self._config, sink), **self._jit_kwargs).trace(*args, **kwargs)
    return Report([m for r in sink for m in r.matches], [n for r in sink[:1] for n in r.notes])

  def __get__(self, obj, objtype=None):  # usable as a method decorator, like jax.jit
    if obj is None:
      return self
    return functools.partial(self, obj)


def jit(fun: Callable | None = None, /, *, overlap_config: OverlapConfig | None = None,
        **jit_kwargs: Any):
  """Drop-in `jax.jit` that fuses collective matmuls inside shard_map bodies.

  Every keyword of jax.jit (in/out_shardings, static_argnums, donate_argnums,
  ...) is forwarded.  `overlap_config` sets how the fused ops run.
  """
  if fun is None:
    as_overlap_config(overlap_config, "ao.jit: overlap_config")
    return functools.partial(jit, overlap_config=overlap_config, **jit_kwargs)
  return AutoOverlapJit(fun, overlap_config, **jit_kwargs)


def explain(fun: Callable, *args, overlap_config: OverlapConfig | None = None, **kwargs) -> Report:
  """Report, for every all_gather/psum_scatter next to a matmul in `fun`, fused or skipped and why."""
  if isinstance(fun, AutoOverlapJit):
    return fun.explain(*args, **kwargs)
  return AutoOverlapJit(fun, overlap_config).explain(*args, **kwargs)
