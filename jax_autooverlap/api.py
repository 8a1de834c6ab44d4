"""`ao.jit` and `ao.explain`: jax.jit with the collective-matmul rewrite applied.

`jit(f)` wraps `jax.jit` around a function that, at trace time, traces `f`
to a jaxpr, plans the rewrite and re-emits the program with fused ops.  The
rewrite therefore runs once per input signature, exactly when jax.jit traces,
and a later call costs what a jax.jit call costs.

Called at top level, the program is compiled with custom calls kept out of
XLA's CUDA graphs (runtime/context.py says why), so the GPU kernels may run
anywhere in it, loop bodies included.  Called inside another transformation,
the outermost program decides how everything is compiled: inside another
top-level ao.jit the promise holds; inside a plain jax.jit (or grad, vmap
outside any jit) it does not, and the kernels run only if XLA_FLAGS keeps
custom calls out of graphs.  One jax.jit object per case, so that a trace
made under one promise is never reused under the other.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from jax_autooverlap._compat import under_a_transformation
from jax_autooverlap.rewrite import Interpreter, Report, analyze
from jax_autooverlap.runtime import context
from jax_autooverlap.tuning.config import OverlapConfig


def _rewriting(fun: Callable, config: OverlapConfig, graph_safe: bool,
               sink: list | None = None) -> Callable:
  @functools.wraps(fun)
  def rewritten(*args, **kwargs):
    with context.compiled_without_custom_calls_in_graphs(graph_safe):
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


def _check_config(config) -> OverlapConfig:
  if config is None:
    return OverlapConfig()
  if isinstance(config, OverlapConfig):
    return config
  hint = (f"ao.OverlapConfig(**{config!r})" if isinstance(config, dict)
          else "ao.OverlapConfig(impl=..., chunks=...)")
  raise TypeError(f"ao.jit: overlap_config must be an ao.OverlapConfig, got "
                  f"{type(config).__name__}; pass {hint}")


class AutoOverlapJit:
  """What `ao.jit` returns: callable like the `jax.jit` object it wraps."""

  def __init__(self, fun: Callable, overlap_config: OverlapConfig | None = None, **jit_kwargs):
    if not callable(fun):
      raise TypeError(f"ao.jit expects a callable, got {type(fun).__name__}")
    self._fun = fun
    self._config = _check_config(overlap_config)
    user_options = dict(jit_kwargs.pop("compiler_options", None) or {})
    command_buffer = user_options.get("xla_gpu_enable_command_buffer")  # the user's, if set
    self._graph_safe = command_buffer is None or "CUSTOM_CALL" not in str(command_buffer).upper()
    top_options = dict(user_options)
    if command_buffer is None:
      top_options.update(context.compiler_options_keeping_custom_calls_out_of_graphs())
    self._top_kwargs = dict(jit_kwargs, compiler_options=top_options)
    self._jitted = jax.jit(_rewriting(fun, self._config, self._graph_safe), **self._top_kwargs)
    self._inner = {safe: jax.jit(_rewriting(fun, self._config, safe), **jit_kwargs,
                                 compiler_options=user_options or None)
                   for safe in (False, True)}
    functools.update_wrapper(self, fun)

  def __call__(self, *args, **kwargs):
    if under_a_transformation():
      # compiled as part of an outer program: is that a top-level ao.jit's?
      return self._inner[context.tracing_for_graph_safe_program()](*args, **kwargs)
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
    jax.jit(_rewriting(self._fun, self._config, self._graph_safe, sink),
            **self._top_kwargs).trace(*args, **kwargs)
    return Report([m for r in sink for m in r.matches])

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
    _check_config(overlap_config)
    return functools.partial(jit, overlap_config=overlap_config, **jit_kwargs)
  return AutoOverlapJit(fun, overlap_config, **jit_kwargs)


def explain(fun: Callable, *args, overlap_config: OverlapConfig | None = None, **kwargs) -> Report:
  """Report, for every all_gather/psum_scatter next to a matmul in `fun`, fused or skipped and why."""
  if isinstance(fun, AutoOverlapJit):
    return fun.explain(*args, **kwargs)
  return AutoOverlapJit(fun, overlap_config).explain(*args, **kwargs)
