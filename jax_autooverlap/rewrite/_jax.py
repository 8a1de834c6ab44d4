"""The few JAX internals the rewrite relies on, in one place.

jaxpr types come from `jax.extend.core`; the source-info helpers that
`jax.core.eval_jaxpr` itself uses come from `jax._src` (no public API).
"""
from __future__ import annotations

import collections

import functools
import importlib.util
import os

import jax
from jax.extend import core as jex_core
from jax._src import source_info_util

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
Literal = jex_core.Literal
Var = jex_core.Var


def is_var(v) -> bool:
  return isinstance(v, Var)


def _jaxprs_in(value):
  if isinstance(value, ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _jaxprs_in(item)


def sub_jaxprs(params) -> list:
  """Every (open) Jaxpr held in an equation's params: bodies, branches, calls."""
  return [j for value in params.values() for j in _jaxprs_in(value)]


def map_jaxprs(params, fn):
  """params with every Jaxpr/ClosedJaxpr value replaced by fn(value) (same type)."""
  def sub(value):
    if isinstance(value, (ClosedJaxpr, Jaxpr)):
      return fn(value)
    if isinstance(value, tuple):
      return tuple(sub(v) for v in value)
    if isinstance(value, list):
      return [sub(v) for v in value]
    return value
  return {k: sub(v) for k, v in params.items()}


# Libraries whose frames are not the user's: a row names the first frame outside them (and
# outside JAX, which JAX's own filter drops).
LIBRARIES = ("flax", "equinox", "optax", "haiku", "jax_autooverlap")


@functools.cache
def _library_dirs() -> tuple[str, ...]:
  dirs = []
  for name in LIBRARIES:
    try:
      spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
      continue
    for loc in (spec.submodule_search_locations or []) if spec else []:
      dirs.append(os.path.join(os.path.realpath(loc), ""))
  return tuple(dirs)


def source_line(eqn) -> str:
  """The user's line an equation comes from: its first frame outside JAX and the libraries
  models are written with (flax, equinox, optax, haiku) and this package."""
  try:
    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
  except Exception:
    return "?"
  libs = _library_dirs()
  for frame in frames:
    if not os.path.realpath(frame.file_name).startswith(libs):
      return source_info_util._summarize_frame(frame)
  return source_info_util._summarize_frame(frames[0]) if frames else "?"


def forward_mode(values) -> bool:
  """Are any of these values forward-mode tangent tracers (jax.jvp, jax.jacfwd)?"""
  from jax._src.interpreters import ad
  return any(isinstance(v, ad.JVPTracer) for v in values)


def make_jaxpr(fn, *args):
  """jax.make_jaxpr(fn)(*args), its equations with the Python frames that made them.

  Inside a custom_vjp rule JAX gives every equation the rule's call site for a
  traceback; the rewrite's rows must name the user's lines instead.
  """
  holder = source_info_util._source_info_context
  prev = holder.context
  holder.context = source_info_util.SourceInfo(None, prev.name_stack)  # no traceback override
  try:
    return jax.make_jaxpr(fn)(*args)
  finally:
    holder.context = prev


def eqn_context(eqn):
  """The context jax.core.eval_jaxpr binds an equation under (source info, name stack)."""
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)


def phase(eqn, outer: str = "fwd") -> str:
  """Where an equation runs in a differentiated program: "fwd", "bwd" or "remat".

  JAX names the equations of a transposed (VJP) program with a `transpose`
  transform in their name stack, and the forward recomputed there by
  `jax.checkpoint` with a `rematted_computation` scope.  Name stacks inside a
  sub-jaxpr are relative to the enclosing equation: `outer` is its phase.
  """
  stack = eqn.source_info.name_stack.stack
  bwd = outer != "fwd" or any(isinstance(s, source_info_util.Transform) and s.name == "transpose"
                              for s in stack)
  remat = outer == "remat" or any(isinstance(s, source_info_util.Scope)
                                  and s.name == "rematted_computation" for s in stack)
  return ("remat" if remat else "bwd") if bwd else "fwd"


def dataflow(jaxpr):
  """(uses, producer, outvars) of a jaxpr: the equation indices reading each var (in order,
  once each), the index of the equation defining it, and the jaxpr's output vars."""
  uses, producer = collections.defaultdict(list), {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if is_var(v):
        readers = uses[v]
        if not readers or readers[-1] != i:
          readers.append(i)
    for v in eqn.outvars:
      producer[v] = i
  return uses, producer, {v for v in jaxpr.outvars if is_var(v)}
